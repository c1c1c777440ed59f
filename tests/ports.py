"""A free TCP port for tests that hand one to an outside launcher (torchrun's rendezvous) or
that need a port nothing listens on. dpfy's own runs never do this: their store listens on a
port the OS chose before any rank learns it (``dpfy.training.launch``)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
