"""Error answers: every 4xx carries one line per mistake, naming the field and the fix, the same lines
the CLI prints for a spec; never the offending input (NaN, say, would not even encode as JSON)."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel



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
    def __init__(self, errors: list[tuple[str, str]], source: str = "body"):
        self.errors, self.source = errors, source


def invalid(errors: list[tuple[str, str]], source: str = "body") -> JSONResponse:
    detail = [{"loc": [source, *where.split(".")] if where else [source],
               "msg": f"{where}: {msg}" if where else msg, "type": "value_error"} for where, msg in errors]
    return JSONResponse({"detail": detail}, status_code=422)


async def on_spec_invalid(request: Request, exc: SpecInvalid) -> JSONResponse:
    return invalid(exc.errors, exc.source)


async def on_request_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    """Path and query parameters (the body of POST /tune is checked by SpecChecker)."""
    detail = []
    for e in exc.errors():
        source, *where = [str(p) for p in e["loc"]]
        path = ".".join(where)
        msg = e["msg"].removeprefix("Value error, ")
        detail.append({"loc": [source, *where], "msg": f"{path}: {msg}" if path else msg, "type": e["type"]})
    return JSONResponse({"detail": detail}, status_code=422)


RESPONSES = {
    401: {"model": Problem, "description": "missing or wrong bearer token"},
    404: {"model": Problem, "description": "no such job, trial or trace"},
    409: {"model": Problem, "description": "the job has not succeeded (yet)"},
    413: {"model": Problem, "description": "request body over SLTUNE_MAX_REQUEST_BYTES"},
    422: {"model": Invalid, "description": "a field is invalid; each msg names it and the fix"},
    503: {"model": Problem, "description": "busy or the database is unreachable; retry later"},
}


def responses(*codes: int) -> dict[int, dict]:
    return {c: RESPONSES[c] for c in codes}
