"""Ranks that save and resume together: one run id, and every rank's error line gathered at the end of each phase so
that no rank waits at a collective for one that failed."""

from __future__ import annotations

import errno
import uuid
from typing import Any, Callable, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def together(fn: Callable[[], T], gather: bool = False) -> Any:
    """Run this rank's part of a phase (`fn`), then gather every rank's error line, so a rank that fails does not
    leave the others waiting at the next collective: when any rank failed, every rank raises the first failed
    rank's line (an OSError naming its file, else a ValueError or, for anything else, a RuntimeError). Returns fn's
    result, or with `gather` the list of every rank's."""
    rank, world = rank_world()
    error: BaseException | None = None
    result: Any = None
    try:
        result = fn()
    except Exception as err:   # noqa: BLE001 - every rank must hear of it, whatever it is
        error = err
    if world == 1:
        if error is not None:
            raise error
        return [result] if gather else result
    said = _said(error) if error is not None else None
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, (said, result if gather and error is None else None))
    for k, (line, _) in enumerate(parts):
        if line is not None:
            raise _unsaid(line, k) from error
    return [r for _, r in parts] if gather else result


def _said(err: BaseException) -> tuple[str, ...]:
    if isinstance(err, OSError):
        return ("OSError", str(err.errno or errno.EIO), str(err.strerror or err), str(err.filename or ""))
    kind = "ValueError" if isinstance(err, ValueError) else type(err).__name__
    return (kind, " ".join(str(err).split()))


def _unsaid(said: tuple[str, ...], rank: int) -> Exception:
    if said[0] == "OSError":
        _, code, reason, file = said
        return OSError(int(code), f"on rank {rank}: {reason}", file or None)
    if said[0] == "ValueError":
        return ValueError(f"on rank {rank}: {said[1]}")
    return RuntimeError(f"on rank {rank}: {said[0]}: {said[1]}")
