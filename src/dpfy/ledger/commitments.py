"""The local registry of key commitments: no two secure runs on one machine share a key.

A secure :class:`~dpfy.randomness.Randomness` keys its AES-256-CTR keystream with 32 bytes from
the operating system and keeps a commitment to each key
(:func:`dpfy.randomness.key_commitment`: SHA-256 of a domain tag and the key, never the key).
Two generators keyed alike (a constant key, a key file copied between machines, a seeded OS
source left in by mistake) draw the same noise: two "secure" runs then give identical weights,
and each run's guarantee silently assumes noise the other one also used. No single run's
noise looks wrong, so no statistical check of one run sees it.

A run records its commitments in its ledger's metadata and registers them here before its
first release (:func:`register`); a commitment already registered by another run refuses the
run (:class:`RepeatedKeyError`). ``dpfy audit`` looks the ledger's commitments up again
(:func:`lookup`) and names every other registration of the same key.

The registry is one text file, append-only, one line per commitment:
``<64 hex commitment> <registration token> <UTC time>``; the token is a random string per
generator that the run records beside its commitments, so a reader tells the generator's own
lines from another run's. The
file is ``$DPFY_KEY_REGISTRY`` when set (tests point it at a temporary file; the value ``none``
turns registration off and is recorded as such), else ``$XDG_DATA_HOME/dpfy/key-commitments``,
else ``~/.local/share/dpfy/key-commitments``. Appends hold an exclusive lock (``fcntl.flock``)
from the read that checks to the fsync that ends the write, so two runs starting at once cannot
both register one key. The registry only sees runs of this machine (or of whoever shares the
file): it is a net under the generator, not a proof that no key ever repeats elsewhere.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import time
from collections.abc import Iterable
from pathlib import Path

#: The environment variable naming the registry file (``none``: no registration).
REGISTRY_ENV = "DPFY_KEY_REGISTRY"
#: How a ledger records that its run registered nothing.
NO_REGISTRY = "none"

_LINE = re.compile(r"^([0-9a-f]{64}) (\S+) (\S+)$")


class RepeatedKeyError(RuntimeError):
    """A secure generator drew a key that another run already used (or two generators of one
    run drew one key): the run is refused before it releases anything."""


def registry_path() -> Path | None:
    """The registry file (module docstring), or ``None`` when ``$DPFY_KEY_REGISTRY`` is
    ``none``."""
    env = os.environ.get(REGISTRY_ENV)
    if env:
        return None if env.strip().lower() == NO_REGISTRY else Path(env)
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                          "share")
    return Path(data) / "dpfy" / "key-commitments"


def new_token() -> str:
    """A fresh registration token (16 random hex digits)."""
    return secrets.token_hex(8)


def _entries(text: str) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            out.setdefault(m.group(1), []).append((m.group(2), m.group(3)))
    return out


def register(commitments: Iterable[str], token: str) -> Path | None:
    """Register a run's key commitments under ``token``; the registry file, or ``None`` when
    registration is off.

    Raises:
      RepeatedKeyError: a commitment is registered under another token (another run drew the
        same key); nothing is written then.
      OSError: the registry cannot be read or written (named, with how to choose another).
    """
    wanted = list(dict.fromkeys(commitments))
    path = registry_path()
    if path is None or not wanted:
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as err:
        raise OSError(f"the key registry {str(path)!r} cannot be opened ({err.strerror}); set "
                      f"{REGISTRY_ENV} to a writable file") from None
    with os.fdopen(fd, "r+", encoding="ascii") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        known = _entries(fh.read())
        for c in wanted:
            others = [(t, when) for t, when in known.get(c, []) if t != token]
            if others:
                raise RepeatedKeyError(
                    f"the secure generator drew a key (commitment {c[:16]}...) that another run "
                    f"registered at {others[0][1]} in {str(path)!r}: two runs with one key draw "
                    "the same noise. The run is refused; the operating system's random source "
                    "(os.urandom) or the generator's keying is broken"
                )
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        fh.write("".join(f"{c} {token} {when}\n" for c in wanted if c not in known))
        fh.flush()
        os.fsync(fh.fileno())
    return path


def lookup(commitments: Iterable[str]) -> tuple[Path | None, dict[str, list[tuple[str, str]]]]:
    """(the registry file, ``{commitment: [(token, time), ...]}`` for each given commitment
    registered there); an absent or unreadable registry, or registration off, gives ``{}``."""
    path = registry_path()
    if path is None or not path.is_file():
        return path, {}
    try:
        known = _entries(path.read_text(encoding="ascii", errors="replace"))
    except OSError:
        return path, {}
    return path, {c: known[c] for c in commitments if c in known}
