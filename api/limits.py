"""A request body limit enforced on the bytes as they arrive, so a chunked body (no Content-Length)
cannot stream more than the server accepts into memory before auth or validation run."""

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
        body = json.dumps({"detail": f"request body over {self.limit} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
