"""Bearer-token auth for writes: the token comes from SLTUNE_API_TOKEN; reads stay open."""

from __future__ import annotations

import hmac

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

_bearer = HTTPBearer(auto_error=False, description="SLTUNE_API_TOKEN")


def require_token(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    expected = request.app.state.settings.api_token
    if expected is None:
        return      # no token configured: a local server on loopback (serve refuses other hosts)
    given = creds.credentials if creds is not None and creds.scheme.lower() == "bearer" else ""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or wrong bearer token (SLTUNE_API_TOKEN)",
                            headers={"WWW-Authenticate": "Bearer"})
