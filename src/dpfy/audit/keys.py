"""The run's key commitments against the local registry (:mod:`dpfy.ledger.commitments`).

A secure run records a commitment to each key its generators drew (metadata
``key_commitments``: ``{"noise": [...], "sampling": [...]}``, with each generator's
registration token, ``key_registration``); a seeded run records ``"seeded"``.
:func:`key_check` finds:

* one key drawn by both of the run's generators (they drew the same bits);
* a commitment that the registry holds under another registration: another run on this machine
  drew the same key, so the two runs' noise is the same (their weights are identical when the
  data and the recipe are);

and notes what it could not check (a ledger that records no commitments; a commitment that this
machine's registry does not hold: a run made elsewhere, or with registration off). Cost: one
read of the registry file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpfy.ledger.commitments import lookup


def _commitments(meta: Mapping[str, Any]) -> dict[str, list[str]] | None:
    value = meta.get("key_commitments")
    if not isinstance(value, dict):
        return None
    return {str(k): [c for c in v if isinstance(c, str)] for k, v in value.items()
            if isinstance(v, list)}


def key_check(meta: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(findings, notes) on the keys a run's ledger metadata ``meta`` committed to."""
    recorded = meta.get("key_commitments")
    if recorded == "seeded":
        return (), ("keys: a seeded run (not a DP release): no key to commit to",)
    gens = _commitments(meta)
    if gens is None and meta.get("trainer") == "dpfy.fed.DPFedAvg":
        return (), ("keys: not checked (the federated server, dpfy.fed.DPFedAvg, records no key "
                    "commitment)",)
    if gens is None:
        secure = str(meta.get("noise_randomness", "")).startswith("secure")
        return (), (("keys: the ledger records no key commitment (written before dpfy recorded "
                     "them, or by a path that records none): not checked",) if secure else ())
    findings: list[str] = []
    noise, sampling = set(gens.get("noise", [])), set(gens.get("sampling", []))
    for c in sorted(noise & sampling):
        findings.append(f"keys: the noise and sampling generators drew one key (commitment "
                        f"{c[:16]}...): they drew the same bits")
    tokens = meta.get("key_registration")
    path, found = lookup(sorted(noise | sampling))
    unseen = 0
    for name, cs in gens.items():
        token = tokens.get(name) if isinstance(tokens, dict) else None
        for c in cs:
            others = [(t, when) for t, when in found.get(c, []) if t != token]
            if others:
                findings.append(
                    f"keys: the {name} generator's key (commitment {c[:16]}...) was also drawn "
                    f"by another run (registered {others[0][1]} in {str(path)!r}): both runs "
                    "drew the same noise"
                )
            unseen += c not in found
    notes = ((f"keys: {unseen} commitment(s) not in this machine's registry "
              f"({str(path) if path else 'registration off'}): a run made elsewhere, or with "
              "registration off; only the run's own generators were compared",)
             if unseen else ())
    return tuple(findings), notes
