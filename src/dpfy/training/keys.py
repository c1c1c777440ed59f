"""The run facts of a run's randomness keys: commitments recorded and registered at the start.

Every secure run (``dpfy train`` without ``--seed``, :func:`dpfy.make_private`, the Hugging
Face ``DPTrainer``, ``dpfy.opacus``) calls :func:`key_facts` before anything is written: the
noise and sampling generators draw their keys now, their commitments
(:meth:`dpfy.randomness.Randomness.key_commitments`) go into the ledger's metadata and into the
local registry (:mod:`dpfy.ledger.commitments`), and a key that another run (or the run's other
generator) already drew refuses the run. A seeded run records that it is seeded (not a DP
release) and registers nothing: its stream is reproducible by design.
"""

from __future__ import annotations

import weakref
from typing import Any

from dpfy.ledger.commitments import NO_REGISTRY, RepeatedKeyError, new_token, register
from dpfy.randomness import Randomness

#: Each generator's registration token: a generator handed to a second run continues its
#: keystream (no bit repeats), so its keys are registered under the same token again.
_TOKENS: weakref.WeakKeyDictionary[Randomness, str] = weakref.WeakKeyDictionary()


def _token(generator: Randomness) -> str:
    token = _TOKENS.get(generator)
    if token is None:
        token = _TOKENS[generator] = new_token()
    return token


def key_facts(noise: Randomness, sampling: Any = None) -> dict[str, Any]:
    """The ledger metadata of the run's keys, after registering them (module docstring).

    Args:
      noise: the run's noise generator.
      sampling: the sampler's generator (None, or an object that is no ``Randomness``: a
        sampler without one).

    Returns ``{"key_commitments": {"noise": [...], "sampling": [...]}, "key_registration":
    {"noise": token, "sampling": token}, "key_registry": "local" | "none"}`` when a generator
    is secure (a token per generator object: the same generator in a later run continues its
    stream and is no repeat), else ``{"key_commitments": "seeded"}``.

    Raises:
      RepeatedKeyError: two generators of the run drew one key, or another run drew it.
      OSError: the registry cannot be written (named).
    """
    gens = {"noise": noise}
    if isinstance(sampling, Randomness):
        gens["sampling"] = sampling
    commitments = {name: list(g.key_commitments()) for name, g in gens.items()}
    if not any(commitments.values()):
        return {"key_commitments": "seeded"}
    if "sampling" in gens and gens["sampling"] is not noise:
        shared = set(commitments["noise"]) & set(commitments["sampling"])
        if shared:
            raise RepeatedKeyError(
                "the run's noise and sampling generators drew one key (commitment "
                f"{sorted(shared)[0][:16]}...): they would draw the same bits. The run is "
                "refused; the operating system's random source (os.urandom) or the generator's "
                "keying is broken"
            )
    tokens: dict[str, str] = {}
    path = None
    for name, g in gens.items():
        if commitments[name]:
            tokens[name] = _token(g)
            path = register(commitments[name], tokens[name])
    return {
        "key_commitments": {k: v for k, v in commitments.items() if v},
        "key_registration": tokens,
        "key_registry": NO_REGISTRY if path is None else "local",
    }
