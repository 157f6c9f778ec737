"""A free port on loopback, where ranks on this machine rendezvous (a trial's, calibrate's collectives, a one-rank
process group a backend needs)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port no socket holds now: another process may take it before it is bound again, which a rendezvous that
    fails then says."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
