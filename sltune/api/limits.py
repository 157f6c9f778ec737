"""Checks on the raw request, before any route runs: a body limit enforced on the bytes as they arrive,
so a chunked body (no Content-Length) cannot stream more than the server accepts into memory before
auth or validation run; and no NUL byte in the path or query, which no job id or filter contains and
PostgreSQL refuses in text (a 500 if it got that far)."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException


class BodyLimit:
    """ASGI middleware: 413 for any request whose body exceeds `limit` bytes."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._reject(send)
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:   # an HTTPException passes through FastAPI's body parsing as it is
                    raise HTTPException(413, f"request body over {self.limit} bytes")
            return message

        await self.app(scope, counted_receive, send)

    async def _reject(self, send) -> None:
        await answer(send, 413, {"detail": f"request body over {self.limit} bytes"})


class NoNul:
    """ASGI middleware: a NUL byte in the path is a 404 (no such resource), in the query a 422."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            if "\x00" in scope["path"]:
                return await answer(send, 404, {"detail": "no such resource: the path holds a NUL byte"})
            query = scope.get("query_string", b"")
            if b"%00" in query or b"\x00" in query:
                return await answer(send, 422, {"detail": [{"loc": ["query"], "type": "value_error",
                                                            "msg": "query: a NUL byte (%00) is never a valid value; "
                                                                   "remove it"}]})
        return await self.app(scope, receive, send)


async def answer(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
