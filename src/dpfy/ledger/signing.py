"""Signing a ledger's chain head: one Ed25519 key per run, kept outside the run directory.

The hash chain (:mod:`dpfy.ledger.chain`) has no secret: whoever can write the file can write
a new, self-consistent chain. A signature closes that gap for anyone who holds the run's public
key from somewhere the file's writer cannot change (the report, the model card). Each file
ledger draws a fresh Ed25519 key pair (RFC 8032) when it is created; the header carries the
public key, and the private key is written to ``<key dir>/<run_id>.key`` (PKCS #8 PEM, mode
0600), where the key directory is ``$DPFY_KEY_DIR``, else ``$XDG_CONFIG_HOME/dpfy/keys``, else
``~/.config/dpfy/keys``. A key directory inside the run directory is refused: a private key
shipped beside the ledger would let anyone re-sign a rewritten file.

What is signed: the UTF-8 bytes ``dpfy-ledger-head\\0<run_id>\\0<lines>\\0<head>``, where
``head`` is the SHA-256 (hex) of line ``lines`` of the file. Verification needs the public key
only. ``cryptography`` is imported when a key is drawn, used or checked.

This module imports neither torch nor the accountants.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from dpfy.ledger.logfile import write_fully

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

#: Environment variable naming the directory of private run keys.
KEY_DIR_ENV = "DPFY_KEY_DIR"
_DOMAIN = b"dpfy-ledger-head"
_HEX = frozenset("0123456789abcdef")


class LedgerKeyError(RuntimeError):
    """A run's private key cannot be written, found or used."""


def key_dir() -> Path:
    """The directory of private run keys (see the module docstring for the search order)."""
    named = os.environ.get(KEY_DIR_ENV)
    if named:
        return Path(named).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "dpfy" / "keys"


def is_hex(value: object, length: int) -> bool:
    """``value`` is a string of exactly ``length`` lowercase hexadecimal digits."""
    return isinstance(value, str) and len(value) == length and set(value) <= _HEX


def head_message(run_id: str, lines: int, head: str) -> bytes:
    """The bytes a signature covers: line ``lines`` of run ``run_id`` hashes to ``head``."""
    return b"\0".join((_DOMAIN, run_id.encode("ascii"), str(lines).encode("ascii"),
                       head.encode("ascii")))


def _key_path(run_id: str, ledger_path: str) -> Path:
    directory = key_dir().resolve()
    run_dir = Path(ledger_path).resolve().parent
    if directory == run_dir or run_dir in directory.parents:
        raise LedgerKeyError(
            f"the key directory {str(directory)!r} is inside the run directory {str(run_dir)!r}: "
            "a private key beside the ledger lets anyone re-sign a rewritten file. Set "
            f"{KEY_DIR_ENV} to a directory outside it"
        )
    return directory / f"{run_id}.key"


def new_key(run_id: str, ledger_path: str) -> tuple[Ed25519PrivateKey, str]:
    """Draw the run's key pair and store the private key; returns it with the public key (hex).

    Raises:
      LedgerKeyError: the key directory is inside the run directory, or the key cannot be
        written (the file exists already, or the directory is not writable).
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = _key_path(run_id, ledger_path)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            write_fully(fd, pem)
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                path.unlink()  # ours (O_EXCL): no partial key is left behind
            raise
        finally:
            os.close(fd)
    except OSError as err:
        raise LedgerKeyError(
            f"cannot store the run's private signing key at {str(path)!r} "
            f"({err.strerror or err}); set {KEY_DIR_ENV} to a writable directory outside the "
            "run directory"
        ) from None
    return key, public_hex(key)


def forget_key(run_id: str, ledger_path: str) -> None:
    """Remove the stored private key of run ``run_id`` (a run that released nothing: its
    ledger was never written, so nothing is ever signed or resumed with the key)."""
    try:
        _key_path(run_id, ledger_path).unlink()
    except (OSError, LedgerKeyError):
        pass


def load_key(run_id: str, ledger_path: str, public_key: str) -> Ed25519PrivateKey:
    """The stored private key of run ``run_id``, checked against the header's ``public_key``.

    Raises:
      LedgerKeyError: no key for the run in the key directory, or a key of another run.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = _key_path(run_id, ledger_path)
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError) as err:
        raise LedgerKeyError(
            f"the private signing key of run {run_id} is not readable at {str(path)!r} ({err}); "
            f"a signed ledger is appended to only with its own key (set {KEY_DIR_ENV})"
        ) from None
    if not isinstance(key, Ed25519PrivateKey) or public_hex(key) != public_key:
        raise LedgerKeyError(f"{str(path)!r} is not the signing key of run {run_id}")
    return key


def public_hex(key: Ed25519PrivateKey) -> str:
    """The raw 32-byte public key of ``key``, as 64 hex digits."""
    from cryptography.hazmat.primitives import serialization

    raw = key.public_key().public_bytes(serialization.Encoding.Raw,
                                        serialization.PublicFormat.Raw)
    return raw.hex()


def sign_head(key: Ed25519PrivateKey, run_id: str, lines: int, head: str) -> str:
    """Ed25519 signature (128 hex digits) of :func:`head_message`."""
    return key.sign(head_message(run_id, lines, head)).hex()


def signature_holds(public_key: str, run_id: str, lines: int, head: str, signature: str) -> bool:
    """Whether ``signature`` is ``public_key``'s signature of :func:`head_message`."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if not (is_hex(public_key, 64) and is_hex(signature, 128)):
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key)).verify(
            bytes.fromhex(signature), head_message(run_id, lines, head)
        )
    except InvalidSignature:
        return False
    return True
