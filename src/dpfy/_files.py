"""Files that appear whole or not at all: written under a temporary name, then renamed.

A run directory may be published as it stands, so a file in it is either complete or absent:
a full disk, a size limit or a read-only directory while a file is written must not leave a
0-byte ``model.pt`` or half a ``report.json`` behind. :func:`write_atomic` writes the bytes
to a hidden temporary file in the same directory (``.<name>.<random>.tmp``, which the
publishing list skips), fsyncs it and renames it over the final name with ``os.replace``
(atomic on POSIX within one file system). On any failure the temporary file is removed and
the error is raised as an ``OSError`` that names the final file, so a caller can say in one
line which file could not be written.

Ground layer: imports nothing of dpfy.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO

#: The suffix of a temporary file; a file with it is debris of a write that did not finish.
TEMPORARY_SUFFIX = ".tmp"


def temporary_name(path: Path) -> Path:
    """A fresh hidden name beside ``path`` for its temporary copy."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMPORARY_SUFFIX}")


def write_atomic(
    path: str | os.PathLike[str], content: bytes | str | Callable[[IO[bytes]], object]
) -> Path:
    """Write ``content`` to ``path`` whole or not at all (see the module docstring).

    Args:
      path: the final file; its directory must exist.
      content: the bytes, text (written as UTF-8), or a function that writes into the binary
        file object it is given (e.g. ``lambda f: torch.save(state, f)``).

    Returns:
      ``path`` as a ``Path``.

    Raises:
      OSError: the write, fsync or rename failed (``filename`` is ``path``); nothing was left
        under either name.
    """
    final = Path(path)
    tmp = temporary_name(final)
    try:
        with open(tmp, "xb") as f:
            if isinstance(content, str):
                f.write(content.encode("utf-8"))
            elif isinstance(content, bytes):
                f.write(content)
            else:
                content(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(err, OSError) and err.errno is not None:
            raise OSError(err.errno, err.strerror or str(err), os.fspath(final)) from err
        raise
    return final
