"""The named policies a gateway knows, and which one a request belongs to (docs/architecture.md, decision 13).

Names are cached once seen: a policy is never removed, so a name found stays valid, and a miss (a policy
another gateway process created) reads the store once. The config file's policies are added to the store
as the gateway starts.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Query
from sqlalchemy.engine import Engine as DBEngine
from sqlmodel import Session

from tracetrain.config import (
    DEFAULT_POLICY,
    POLICY_NAME_PATTERN,
    POLICY_NAME_RE,
    POLICY_NAME_RULE,
    Config,
    policy_problem,
)
from tracetrain.proxy.errors import APIError
from tracetrain.store import policy_lines
from tracetrain.store.models import PolicyLine

if TYPE_CHECKING:
    from tracetrain.proxy.auth import Caller


class PolicyLines:
    def __init__(self, db: DBEngine, config: Config) -> None:
        self.db = db
        self.config = config
        self._known: set[str] = {DEFAULT_POLICY}
        self._lock = asyncio.Lock()
        """One creation at a time in this process: the `engine.max_loras` count and the insert go together."""

    async def start(self) -> None:
        declared = [(p.name, p.training, p.settings) for p in self.config.gateway.policies]
        self._known |= set(await asyncio.to_thread(self._ensure, declared))

    def _ensure(self, declared: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
        with Session(self.db) as db:
            policy_lines.ensure(db, declared=declared)
            return policy_lines.names(db)

    async def exists(self, name: str) -> bool:
        if name in self._known:
            return True
        found = await asyncio.to_thread(self._stored, name)
        if found:
            self._known.add(name)
        return found

    def _stored(self, name: str) -> bool:
        with Session(self.db) as db:
            return policy_lines.get(db, name=name) is not None

    async def require(self, name: str, *, param: str | None = None) -> str:
        """`name` if it is a known policy; 404 `policy_not_found` otherwise."""
        if not await self.exists(name):
            raise APIError(404, f"Policy '{name}' does not exist (POST /v1/policies with {{\"name\": ...}} creates "
                           "one).", code="policy_not_found", param=param)
        return name

    async def create(self, name: str, training: str, settings: dict[str, Any]) -> PolicyLine:
        """A new line: 400 with the sentence `policy_problem` gives, 409 when the name is taken, the served
        model's, or one more than `engine.max_loras` allows."""
        if problem := policy_problem(name, training, settings, self.config.train):
            code = "invalid_policy_name" if problem.startswith("Policy name") else (
                "full_weight_policy" if training != "lora" else "invalid_policy_settings")
            raise APIError(400, problem, code=code, param="name" if code == "invalid_policy_name" else None)
        if name == self.config.engine.served_model_name:
            raise APIError(409, f"'{name}' is the served model's name; a policy needs a name of its own.",
                           code="policy_exists", param="name")
        async with self._lock:
            line = await asyncio.to_thread(self._create, name, training, settings)
        self._known.add(line.name)
        return line

    def _create(self, name: str, training: str, settings: dict[str, Any]) -> PolicyLine:
        limit = self.config.engine.max_loras
        with Session(self.db) as db:
            have = policy_lines.names(db)
            if name in have:
                raise APIError(409, f"Policy '{name}' exists already.", code="policy_exists", param="name")
            if len(have) + 1 > limit:
                raise APIError(409, f"Policy '{name}' would make {len(have) + 1} policies, each serving its own LoRA "
                               f"adapter, and the engine serves at most engine.max_loras ({limit}) at once.",
                               code="too_many_policies")
            line = policy_lines.create(db, name=name, training=training, settings=settings)
            if line is None:  # another process took the name meanwhile
                raise APIError(409, f"Policy '{name}' exists already.", code="policy_exists", param="name")
            return line

    async def for_model(self, model: str) -> str | None:
        """The policy a request's `model` names (`model: support`, as OpenAI names fine-tuned models); None for
        the served model's own name; 404 `model_not_found` for anything else."""
        served = self.config.engine.served_model_name
        if model == served:
            return None
        if await self.exists(model):
            return model
        raise APIError(404, f"The model '{model}' does not exist; this gateway serves '{served}' and its named "
                       "policies.", code="model_not_found", param="model")


def check_policy_name(value: str) -> str:
    """A policy name from a path or a query, held to the rule: 400 `invalid_policy` otherwise."""
    if not POLICY_NAME_RE.fullmatch(value):
        raise APIError(400, f"Invalid policy: {POLICY_NAME_RULE}.", code="invalid_policy", param="policy")
    return value


PolicyQuery = Annotated[str | None, Query(min_length=1, max_length=64, pattern=POLICY_NAME_PATTERN,
                                          description="Only this named policy's sessions (404 for an unknown one).")]
"""`?policy=` on the routes that list or export sessions."""


def key_forbidden(caller: Caller, named: str, *, param: str | None = None) -> APIError:
    """403 for a caller confined to one policy that names another."""
    return APIError(403, f"This API key is bound to policy '{caller.policy}'; it cannot reach policy '{named}'.",
                    code="policy_forbidden", param=param)


async def scoped_policy(policies: PolicyLines, caller: Caller, asked: str | None) -> str | None:
    """The one policy a listing or export covers: the one asked for (404 if unknown), limited to the caller's
    own when it is confined to one (asking for another is 403 `policy_forbidden`); None: every policy."""
    if asked is not None:
        await policies.require(asked, param="policy")
        if caller.confined_elsewhere(asked):
            raise key_forbidden(caller, asked, param="policy")
    return asked or caller.policy
