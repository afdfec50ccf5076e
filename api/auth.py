"""Bearer-key authentication, on when `OPENJEV_API_KEY` is set; health routes stay open."""

from __future__ import annotations

import hmac

from fastapi import Request

from api.errors import MissingKey, WrongKey


def require_key(request: Request) -> None:
    """FastAPI dependency: 403 without `Authorization: Bearer <key>`, 401 with a wrong key.
    With auth off, any Authorization header is accepted and ignored (official clients always send one)."""
    expected = request.app.state.services.settings.api_key
    if expected is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise MissingKey("missing API key: send `Authorization: Bearer <key>`")
    if not hmac.compare_digest(token.encode(), expected.get_secret_value().encode()):
        raise WrongKey("invalid API key")
