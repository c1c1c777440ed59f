"""Whose key signed a ledger: the two levels of a verification, and long-lived keys.

A ledger's signature (:mod:`dpfy.ledger.signing`) proves the file unchanged since its run key
signed it, not whose key that is: whoever rewrites a whole ledger draws a key of their own,
signs the result, and the header names that key. A fingerprint stored in the run directory
protects nothing (the forger rewrites it too). So a verification reaches one of two levels:

* **intact** (:data:`INTACT`): the chain holds and is signed by the header's run key, but that
  key was not checked against anything the reader holds apart from the file. This proves the
  file's self-consistency only.
* **verified against the key you trust** (:data:`TRUSTED`): the run key is the one the reader
  pinned (``dpfy report --public-key HEX``), or it is endorsed by a long-lived key the reader
  trusts (``--trust KEYFILE`` or ``--public-key`` with that key's hex).

A long-lived key is an Ed25519 key of an organisation or a user (RFC 8032), kept outside every
run (``dpfy keys new PATH`` writes one, mode 0600, and its public half to ``PATH.pub``).
``dpfy train --signing-key PATH`` uses it to sign the run key: the ledger's metadata records
``run_key_endorsement = {"key": <long-lived public key>, "signature": <128 hex>}``, the
long-lived key's signature of the UTF-8 bytes ``dpfy-run-key\\0<run_id>\\0<run public key>``.
That line is chained and signed by the run key like every other. A forger who re-signs a
rewritten ledger with a fresh run key cannot produce the endorsement of that key, and an
endorsement copied from the original names the original run key, not the forger's.

This module imports neither torch nor the accountants; ``cryptography`` is imported when a key
is made, read or checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpfy.ledger.chain import LedgerIntegrityError, Verification
from dpfy.ledger.signing import is_hex, public_hex

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from dpfy.ledger.ledger import Ledger

#: The run key is checked against a key the reader holds apart from the file.
TRUSTED = "verified against the key you trust"
#: The chain holds under the header's key, which nobody checked.
INTACT = "intact, key not checked"
#: The file names no run key (unsigned, version 1 or in memory): nothing to check.
NO_KEY = "no signing key"

#: The metadata field that holds a long-lived key's endorsement of the run key.
ENDORSEMENT_FIELD = "run_key_endorsement"
_DOMAIN = b"dpfy-run-key"


def fingerprint(public_key: str) -> str:
    """A short name of an Ed25519 public key (64 hex digits): ``sha256:`` and the first 16 hex
    digits of the SHA-256 of its raw 32 bytes."""
    return "sha256:" + hashlib.sha256(bytes.fromhex(public_key)).hexdigest()[:16]


def endorsement_message(run_id: str, run_key: str) -> bytes:
    """The bytes a long-lived key signs to endorse run ``run_id``'s key ``run_key``."""
    return b"\0".join((_DOMAIN, run_id.encode("ascii"), run_key.encode("ascii")))


# -- long-lived keys ------------------------------------------------------------------------


def new_long_lived_key(path: str | os.PathLike[str]) -> str:
    """Draw a long-lived Ed25519 key: its private half to ``path`` (PKCS #8 PEM, mode 0600),
    its public half (64 hex digits and a newline) to ``path.pub``; returns the public key.

    Raises:
      ValueError: ``path`` or ``path.pub`` exists, or cannot be written.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private, public = Path(path), Path(f"{os.fspath(path)}.pub")
    for p in (private, public):
        if p.exists():
            raise ValueError(f"path must name a new key file, {str(p)!r} exists (a key is "
                             "never overwritten)")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    hex_key = public_hex(key)
    try:
        fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, pem)
            os.fsync(fd)
        finally:
            os.close(fd)
        public.write_text(hex_key + "\n", encoding="ascii")
    except OSError as err:
        private.unlink(missing_ok=True)
        raise ValueError(f"path: cannot write the key to {str(private)!r} "
                         f"({err.strerror or err})") from None
    return hex_key


def load_long_lived_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """The long-lived private key in ``path`` (written by :func:`new_long_lived_key`).

    Raises:
      ValueError: the file cannot be read or holds no Ed25519 private key.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"signing_key must be an Ed25519 private key file (PEM, as `dpfy keys "
                         f"new` writes), got {os.fspath(path)!r}: {err}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"signing_key must be an Ed25519 private key, got a "
                         f"{type(key).__name__} in {os.fspath(path)!r}")
    return key


def read_trusted_key(path: str | os.PathLike[str]) -> str:
    """The public key (64 hex digits) in a file you trust: the ``.pub`` file of
    :func:`new_long_lived_key` (or any file holding the 64 hex digits), a PEM public key, or
    the PEM private key itself.

    Raises:
      ValueError: the file cannot be read or holds none of these.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

    where = os.fspath(path)
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"trust: cannot read {where!r} ({err.strerror or err})") from None
    text = data.decode("ascii", errors="replace").strip().lower()
    if is_hex(text, 64):
        return text
    key: object = None
    with contextlib.suppress(ValueError, TypeError):
        key = serialization.load_pem_public_key(data)
    if key is None:
        with contextlib.suppress(ValueError, TypeError):
            key = serialization.load_pem_private_key(data, password=None)
    if isinstance(key, Ed25519PrivateKey):
        return public_hex(key)
    if isinstance(key, Ed25519PublicKey):
        return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
    raise ValueError(f"trust must be a file holding an Ed25519 public key (64 hex digits, as "
                     f"`dpfy keys new` writes to KEY.pub, or PEM), got {where!r}")


def check_public_key(name: str, value: str) -> str:
    """``value`` if it is an Ed25519 public key as 64 lowercase hex digits.

    Raises:
      ValueError: it is not.
    """
    if not is_hex(value, 64):
        raise ValueError(f"{name} must be an Ed25519 public key as 64 lowercase hex digits, "
                         f"got {name}={value!r}")
    return value


def reader_key(public_key: str | None, trust: str | os.PathLike[str] | None) -> str | None:
    """The key a reader trusts, from ``--public-key HEX`` or ``--trust KEYFILE`` (at most one).

    Raises:
      ValueError: both are given, or the one given is not a public key.
    """
    if public_key is not None and trust is not None:
        raise ValueError("public_key and trust name the key you trust twice: give one of them")
    if public_key is not None:
        return check_public_key("public_key", public_key)
    return None if trust is None else read_trusted_key(trust)


# -- endorsing and checking a run key -------------------------------------------------------


def endorse(ledger: Ledger, key: Ed25519PrivateKey) -> dict[str, str]:
    """Sign ``ledger``'s run key with the long-lived ``key`` and record the endorsement in its
    metadata (:data:`ENDORSEMENT_FIELD`); returns it.

    Raises:
      ValueError: the ledger has no run key (in memory or unsigned) or is closed.
    """
    run_key = ledger.verification.public_key
    if ledger.run_id is None or run_key is None or ledger.read_only:
        raise ValueError("ledger must be an open, signed file ledger to endorse its run key")
    signature = key.sign(endorsement_message(ledger.run_id, run_key)).hex()
    endorsement = {"key": public_hex(key), "signature": signature}
    ledger.record_metadata(**{ENDORSEMENT_FIELD: endorsement})
    return endorsement


def endorsing_key(metadata: Mapping[str, Any], run_id: str | None,
                  run_key: str | None) -> str | None:
    """The long-lived public key whose endorsement of ``run_key`` holds (None if none does)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    found = metadata.get(ENDORSEMENT_FIELD)
    if not isinstance(found, dict) or run_id is None or run_key is None:
        return None
    key, signature = found.get("key"), found.get("signature")
    if not (is_hex(key, 64) and is_hex(signature, 128)):
        return None
    assert isinstance(key, str) and isinstance(signature, str)
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(key)).verify(
            bytes.fromhex(signature), endorsement_message(run_id, run_key))
    except (InvalidSignature, ValueError):
        return None
    return key


@dataclasses.dataclass(frozen=True, slots=True)
class KeyTrust:
    """What a reader knows about the key that signed a ledger.

    Attributes:
      level: :data:`TRUSTED`, :data:`INTACT` or :data:`NO_KEY`.
      run_key: the header's run key (64 hex digits; None without one).
      endorsed_by: the long-lived key whose endorsement of the run key holds (None if none).
      trusted_key: the key the reader trusts (None: none was given).
    """

    level: str
    run_key: str | None = None
    endorsed_by: str | None = None
    trusted_key: str | None = None

    @property
    def verified(self) -> bool:
        """The run key is checked against the key the reader trusts."""
        return self.level == TRUSTED

    def describe(self) -> str:
        """One line: which key signed, and whether it was checked."""
        if self.level == NO_KEY or self.run_key is None:
            return "no signing key: who wrote the file cannot be checked"
        signer = f"run key {fingerprint(self.run_key)}"
        if self.endorsed_by is not None:
            signer += f", endorsed by long-lived key {fingerprint(self.endorsed_by)}"
        if self.level == TRUSTED:
            assert self.trusted_key is not None
            return f"verified against the key you trust ({fingerprint(self.trusted_key)}): {signer}"
        return (f"signed by {signer}; key not checked: this proves self-consistency only "
                "(verify with --trust KEYFILE or --public-key HEX)")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(verified=self.verified, summary=self.describe())
        return out


def assess(verification: Verification, metadata: Mapping[str, Any],
           trusted_key: str | None = None, *, source: str = "ledger") -> KeyTrust:
    """The trust a reader holding ``trusted_key`` (None: no key) can place in a ledger's key.

    ``trusted_key`` is trusted when it is the header's run key or a long-lived key whose
    endorsement of the run key (in ``metadata``) holds.

    Raises:
      LedgerIntegrityError: a ``trusted_key`` was given and the ledger's key is neither it
        nor endorsed by it (a rewritten and re-signed ledger, or another signer's).
      ValueError: ``trusted_key`` is not 64 lowercase hex digits.
    """
    run_key = verification.public_key
    endorsed = endorsing_key(metadata, verification.run_id, run_key)
    if trusted_key is None:
        return KeyTrust(INTACT if run_key else NO_KEY, run_key, endorsed)
    check_public_key("trusted_key", trusted_key)
    if run_key is not None and trusted_key in (run_key, endorsed):
        return KeyTrust(TRUSTED, run_key, endorsed, trusted_key)
    what = ("names no signing key" if run_key is None else
            f"is signed by run key {fingerprint(run_key)}"
            + (f" endorsed by {fingerprint(endorsed)}" if endorsed else ", endorsed by no "
               "long-lived key"))
    raise LedgerIntegrityError(
        f"{source} {what}, not by the key you trust, kept apart from the file "
        f"({fingerprint(trusted_key)}): it was "
        "rewritten and re-signed, or another signer's; refused", line=1)
