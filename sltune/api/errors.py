"""Error answers: every 4xx carries one line per mistake, naming the field and the fix, the same lines
the CLI prints for a spec; never the offending input (NaN, say, would not even encode as JSON)."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from sltune.field_errors import field_error
from sltune.store.faults import describe, is_full, is_unreachable

log = logging.getLogger("sltune.api")


class Problem(BaseModel):
    """A 4xx or 5xx other than 422: what went wrong and what to do."""

    detail: str


class FieldError(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class Invalid(BaseModel):
    """422: one entry per mistake; `msg` is the one-line sentence `sltune tune` prints for it."""

    detail: list[FieldError]


class SpecInvalid(Exception):
    """A POST /tune body the spec checker refused: (field path, message) per mistake."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors


def _entry(source: str, where: list[str], msg: str, kind: str) -> dict:
    path = ".".join(where)
    return {"loc": [source, *where], "msg": f"{path}: {msg}" if path else msg, "type": kind}


async def on_spec_invalid(request: Request, exc: SpecInvalid) -> JSONResponse:
    detail = [_entry("body", where.split(".") if where else [], msg, "value_error") for where, msg in exc.errors]
    return JSONResponse({"detail": detail}, status_code=422)


async def on_request_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    """Path and query parameters (the body of POST /tune is checked by SpecChecker)."""
    detail = []
    for e in exc.errors():
        where, reason = field_error({**e, "loc": e["loc"][1:]})
        detail.append(_entry(str(e["loc"][0]), where.split(".") if where else [], reason, e["type"]))
    return JSONResponse({"detail": detail}, status_code=422)


async def on_store_error(request: Request, exc: Exception) -> JSONResponse:
    """The store failed under a request: 507 when it cannot write (a full disk), 503 when the database cannot
    be reached (retry later); anything else is a 500, in JSON like every other answer."""
    if is_full(exc):
        log.error("%s %s: the store cannot write: %s", request.method, request.url.path, describe(exc))
        return JSONResponse({"detail": "the server's storage is full, so nothing can be stored; free space in its "
                                       "data directory (or on the database's disk) and retry"}, status_code=507)
    if is_unreachable(exc):
        log.error("%s %s: the database is unreachable: %s", request.method, request.url.path, describe(exc))
        return JSONResponse({"detail": "the database is unreachable; retry in a few seconds"}, status_code=503,
                            headers={"Retry-After": "5"})
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return await on_unexpected(request, exc)


async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    """Any other failure: a JSON 500 (Starlette then logs the traceback)."""
    return JSONResponse({"detail": f"internal error ({type(exc).__name__}); the server's log has the details"},
                        status_code=500)


RESPONSES = {
    401: {"model": Problem, "description": "missing or wrong bearer token"},
    404: {"model": Problem, "description": "no such job, trial or trace"},
    409: {"model": Problem, "description": "the job has not succeeded (yet)"},
    413: {"model": Problem, "description": "request body over SLTUNE_MAX_REQUEST_BYTES"},
    422: {"model": Invalid, "description": "a field is invalid; each msg names it and the fix"},
    503: {"model": Problem, "description": "busy or the database is unreachable; retry later"},
    507: {"model": Problem, "description": "the server's storage is full; nothing was stored"},
}


def responses(*codes: int) -> dict[int, dict]:
    return {c: RESPONSES[c] for c in codes}
