"""API keys: agent keys own the sessions they create; the admin key sees everything.

With no keys configured (allowed on loopback only) every caller is an anonymous admin.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from tracetrain.proxy.errors import APIError


@dataclass(frozen=True)
class Caller:
    owner: str | None
    """Fingerprint of the caller's key; None when the gateway runs without keys."""
    admin: bool

    def may_access(self, session_owner: str | None) -> bool:
        return self.admin or session_owner == self.owner


ADMIN = Caller(owner=None, admin=True)
"""Who an admin-only route acts as once its `AdminDep` has let the caller in."""


def fingerprint(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class KeyRing:
    def __init__(self, api_keys: list[str], admin_key: str | None, *, untrained: Sequence[str] = ()) -> None:
        self.open = not api_keys and not admin_key
        self._agents = {fingerprint(k) for k in api_keys}
        self._admin = fingerprint(admin_key) if admin_key else None
        self._untrained = {fingerprint(k) for k in untrained}

    def trains(self, owner: str | None) -> bool:
        """Whether sessions of the key with fingerprint `owner` may be trained on (`gateway.api_keys`)."""
        return owner not in self._untrained

    def identify(self, authorization: str | None) -> Caller:
        if self.open:
            return Caller(owner=None, admin=True)
        if not authorization or not authorization.lower().startswith("bearer "):
            raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                           code="missing_api_key")
        print_ = fingerprint(authorization[7:].strip())
        if self._admin is not None and hmac.compare_digest(print_, self._admin):
            return Caller(owner=print_, admin=True)
        if print_ in self._agents:
            return Caller(owner=print_, admin=False)
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


async def get_caller(request: Request) -> Caller:
    # `async` although it never awaits: FastAPI runs a plain `def` dependency in a worker thread, a
    # thread hop on every request (profiled at c=1).
    keys: KeyRing = request.app.state.gateway.keys
    # Anthropic's SDKs send the key as `x-api-key`.
    api_key = request.headers.get("x-api-key")
    return keys.identify(request.headers.get("authorization") or (f"Bearer {api_key}" if api_key else None))


async def get_admin(caller: Annotated[Caller, Depends(get_caller)]) -> Caller:
    if not caller.admin:
        raise APIError(403, "This endpoint needs the admin key.", code="admin_required")
    return caller


CallerDep = Annotated[Caller, Depends(get_caller)]
AdminDep = Annotated[Caller, Depends(get_admin)]
