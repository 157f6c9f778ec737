"""When the database fails under a process: which failures pass, and riding them out.

A PostgreSQL restart or failover drops every connection and refuses new ones for a few seconds ("Connection
refused", "the database system is starting up"); a full disk refuses writes until space is freed. Neither is
the job's fault, so workers retry each store call through them, with backoff, for a bounded time
(`Settings.db_retry_s`, by default the lease) and a job fails only for its own reasons. The API does not wait:
it answers 503 (unreachable, retry later) or 507 (the store cannot write) at once.
"""

from __future__ import annotations

import errno
import functools
import logging
import time
from typing import Any, Callable, TypeVar

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

log = logging.getLogger("sltune.store")
T = TypeVar("T")

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_FULL_TEXT = ("database or disk is full", "no space left on device", "disk quota exceeded", "could not extend file",
              "could not write to file")


def _chain(err: BaseException) -> list[BaseException]:
    """err and its causes (Optuna wraps SQLAlchemy's errors, which wrap the driver's)."""
    seen: list[BaseException] = []
    while err is not None and err not in seen and len(seen) < 8:
        seen.append(err)
        err = err.__cause__ or err.__context__ or getattr(err, "orig", None)
    return seen


def is_full(err: BaseException) -> bool:
    """The store (or the disk under it) has no room to write: SQLite's SQLITE_FULL, PostgreSQL's disk_full
    (53100) or an ENOSPC."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if getattr(e, "sqlstate", None) == "53100":       # PostgreSQL's disk_full
            return True
        if isinstance(e, (DBAPIError, OSError)) or type(e).__module__.startswith(("sqlite3", "psycopg")):
            if any(t in str(e).lower() for t in _FULL_TEXT):
                return True
    return False


def is_unreachable(err: BaseException) -> bool:
    """The database dropped or refused the connection, or cannot serve yet (starting up, shutting down,
    a failover): a retry later may well succeed."""
    for e in _chain(err):
        if isinstance(e, DBAPIError) and e.connection_invalidated:
            return True
        if isinstance(e, (OperationalError, InterfaceError)):
            return True
    return False


def is_transient(err: BaseException) -> bool:
    return is_full(err) or is_unreachable(err)


def describe(err: BaseException) -> str:
    """One line for a log or an answer: the driver's error and its first line, without SQL or parameters."""
    chain = _chain(err)
    driver = next((e.orig for e in chain if isinstance(e, DBAPIError) and e.orig is not None), None)
    shown = driver if driver is not None else err
    text = str(shown).strip().splitlines()
    return f"{type(shown).__name__}: {text[0] if text else ''}".strip()


def retrying(call: Callable[[], T], seconds: float, what: str = "a store call",
             idempotent_after: Callable[[BaseException], bool] | None = None) -> T:
    """call(), retried through transient database failures with backoff (0.1 s doubling to 2 s) for up to
    `seconds`; then the last failure is raised. `idempotent_after(err)` says whether an error raised by a
    retry means the first attempt went through after all (its commit landed but its answer was lost)."""
    deadline = time.monotonic() + seconds
    delay = 0.1
    failed = False
    while True:
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - sorted below
            if failed and idempotent_after is not None and idempotent_after(err):
                return True  # type: ignore[return-value]
            if not is_transient(err) or time.monotonic() + delay > deadline:
                raise
            if not failed:
                log.warning("%s failed (%s); retrying for up to %.0fs", what, describe(err), seconds)
            failed = True
        time.sleep(delay)
        delay = min(delay * 2, 2.0)


def durable(cls: type) -> type:
    """Class decorator: every public method retried as `retrying` does, for the instance's `retry_s`
    seconds (0: no retries)."""
    for name, fn in list(vars(cls).items()):
        if name.startswith("_") or not callable(fn) or isinstance(fn, (staticmethod, classmethod, type)):
            continue
        setattr(cls, name, _retried(fn))
    return cls


def _retried(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(self, *args: Any, **kwargs: Any) -> Any:
        if not self.retry_s:
            return fn(self, *args, **kwargs)
        return retrying(lambda: fn(self, *args, **kwargs), self.retry_s, f"{type(self).__name__}.{fn.__name__}")
    return call


_DURABLE_RDB: type | None = None


def durable_rdb_storage(url: str, engine_kwargs: dict[str, Any]) -> Any:
    """Optuna's RDB storage whose every call is retried through transient database failures for the storage's
    `retry_s` seconds (0, its default: none). A finished trial's state written again by a retry (the first write
    landed, its answer was lost) is no error. (Optuna is imported here, not by every user of the store.)"""
    global _DURABLE_RDB
    if _DURABLE_RDB is None:
        import optuna

        def retried(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def call(self, *args: Any, **kwargs: Any) -> Any:
                if not self.retry_s:
                    return fn(self, *args, **kwargs)
                return retrying(lambda: fn(self, *args, **kwargs), self.retry_s, f"optuna {fn.__name__}",
                                idempotent_after=lambda e: isinstance(e, optuna.exceptions.UpdateFinishedTrialError))
            return call

        methods = {name: retried(getattr(optuna.storages.RDBStorage, name))
                   for name in dir(optuna.storages.BaseStorage)
                   if not name.startswith("_") and name != "remove_session"
                   and callable(getattr(optuna.storages.RDBStorage, name, None))}
        _DURABLE_RDB = type("DurableRDBStorage", (optuna.storages.RDBStorage,),
                            {"retry_s": 0.0, "__module__": __name__, **methods})
    return _DURABLE_RDB(url, engine_kwargs=engine_kwargs)
