"""API keys: agent keys own the sessions they create; the admin key sees everything.

With no keys configured (allowed on loopback only) every caller is an anonymous admin.

A caller may be confined to one named policy: its key's (`gateway.api_keys[].policy`), or for one request the
policy its path names (`/p/{policy}/v1/…`). A confined caller reaches that policy's sessions only, whatever
else its key may do (docs/api.md, "Policies").
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Annotated

from fastapi import Depends, Request

from tracetrain.proxy.errors import APIError
from tracetrain.proxy.policy_lines import check_policy_name, key_forbidden


@dataclass(frozen=True)
class Caller:
    owner: str | None
    """Fingerprint of the caller's key; None when the gateway runs without keys."""
    admin: bool
    policy: str | None = None
    """The one policy this caller may reach (its key's, or the request path's); None: any, as its key allows."""

    def may_access(self, session_owner: str | None) -> bool:
        return self.admin or session_owner == self.owner

    def confined_elsewhere(self, policy: str) -> bool:
        """Whether this caller is confined to a policy other than `policy`."""
        return self.policy is not None and self.policy != policy


ADMIN = Caller(owner=None, admin=True)
"""Who an admin-only route acts as once its `AdminDep` has let the caller in."""


def fingerprint(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class KeyRing:
    def __init__(self, api_keys: list[str], admin_key: str | None, *, untrained: Sequence[str] = (),
                 policies: Mapping[str, str] | None = None) -> None:
        self.open = not api_keys and not admin_key
        self._agents = {fingerprint(k) for k in api_keys}
        self._admin = fingerprint(admin_key) if admin_key else None
        self._untrained = {fingerprint(k) for k in untrained}
        self._policies = {fingerprint(k): p for k, p in (policies or {}).items()}
        """Keys bound to a named policy (`gateway.api_keys[].policy`), by fingerprint."""

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
            return Caller(owner=print_, admin=False, policy=self._policies.get(print_))
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


async def get_caller(request: Request) -> Caller:
    # `async` although it never awaits: FastAPI runs a plain `def` dependency in a worker thread, a
    # thread hop on every request (profiled at c=1).
    keys: KeyRing = request.app.state.gateway.keys
    # Anthropic's SDKs send the key as `x-api-key`.
    api_key = request.headers.get("x-api-key")
    caller = keys.identify(request.headers.get("authorization") or (f"Bearer {api_key}" if api_key else None))
    named = request.path_params.get("policy")
    if named is None:
        return caller
    return replace(caller, policy=await _path_policy(request, caller, named))


async def _path_policy(request: Request, caller: Caller, named: str) -> str:
    """The policy a `/p/{policy}/…` path names, once known to exist and open to the caller: 400 for a name
    against the rule, 404 for an unknown one, 403 `policy_forbidden` when the caller's key is bound to
    another."""
    check_policy_name(named)
    await request.app.state.gateway.policies.require(named)
    if caller.confined_elsewhere(named):
        raise key_forbidden(caller, named)
    return named


async def get_admin(caller: Annotated[Caller, Depends(get_caller)]) -> Caller:
    if not caller.admin:
        raise APIError(403, "This endpoint needs the admin key.", code="admin_required")
    return caller


CallerDep = Annotated[Caller, Depends(get_caller)]
AdminDep = Annotated[Caller, Depends(get_admin)]
