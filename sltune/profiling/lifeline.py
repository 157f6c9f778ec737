"""Processes that die with the process they work for, so that `kill -9` of a worker (or of `sltune serve`)
leaves none of its tree running.

A trial is forked by multiprocessing's fork server, not by the worker, and holds the fork server's own
liveness pipe open; so neither a parent-death signal (its parent is the fork server) nor the fork server
exiting can end it. It watches instead the pipe its result goes back through: when the worker dies the
read end closes, the kernel flags the write end, and the trial kills itself. The fork server itself and
`sltune serve`'s embedded worker use Linux's parent-death signal; SIGKILL, since a graceful stop can
take longer than "a few seconds", and a killed worker's job is taken over when its lease runs out.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
PARENT_ENV = "SLTUNE_FORK_SERVER_PARENT"      # the pid a fork server must die with


def fork_server_dies_with_me() -> None:
    """Call before this process starts multiprocessing's fork server (see sltune.profiling.fork_server)."""
    os.environ[PARENT_ENV] = str(os.getpid())


def exit_when_unread(conn) -> None:
    """Kill this process (SIGKILL, as a crash would) as soon as nobody can read `conn` any more.
    A daemon thread waits in poll(), which costs nothing while the reader is alive."""
    def watch() -> None:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLERR | select.POLLHUP)
        while not poller.poll():
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits; if the parent is already gone
    (it is not `parent`, or not who it was when this call began) send it now. Linux only; elsewhere a
    no-op."""
    if not sys.platform.startswith("linux"):
        return
    parent = parent or os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
