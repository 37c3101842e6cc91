"""Named policies and their versions: create a policy, list them with their versions' training figures,
publish a new version, and promote or roll back a canary by hand (admin only).

A trainer running as its own process (`tracetrain train`) hands each checkpoint to the gateway
here; the gateway owns the engine, so it loads the weights and switches versions atomically.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, cast

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, create_model, field_validator
from sqlmodel import Session

from tracetrain.config import POLICY_NAME_PATTERN, POLICY_TRAIN_SETTINGS, TrainConfig
from tracetrain.engines.base import EngineError
from tracetrain.engines.publishing import ADAPTER_CONFIG, Checkpoint, PublishError, line_version
from tracetrain.proxy.auth import AdminDep
from tracetrain.proxy.errors import APIError, refusal
from tracetrain.proxy.gateway import Gateway, GatewayDep
from tracetrain.proxy.hints import stale_hint
from tracetrain.proxy.openapi import error_responses
from tracetrain.proxy.policy_lines import PolicyQuery, scoped_policy
from tracetrain.proxy.protocol import INTEGRAL, RequestModel
from tracetrain.store import leases, policy_lines, queries
from tracetrain.store.models import DEFAULT_POLICY, Policy, PolicyLine, PolicyLinePublic

router = APIRouter(responses=error_responses(401, 403))


class PublishRequest(RequestModel):
    version: Annotated[int, Field(ge=1), INTEGRAL]
    checkpoint: str = Field(min_length=1)
    """Directory of the checkpoint, as the gateway's machine sees it."""
    kind: Literal["full", "lora"]
    policy: str = Field(default=DEFAULT_POLICY, pattern=POLICY_NAME_PATTERN)
    """The named policy whose line the version continues (a trainer in another process publishes each)."""


class _SettingsModel(RequestModel):
    model_config = ConfigDict(strict=True, extra="forbid")  # a misspelt setting must not be dropped silently


def _optional(name: str) -> tuple[Any, None]:
    """A `train.*` setting as a policy may set it: its config type, or left out."""
    field = TrainConfig.model_fields[name]
    # Its bounds, and for an integer INTEGRAL: JSON Schema's integers include 16.0, which strict mode refuses.
    extra = [INTEGRAL] if field.annotation is int else []
    metadata = [*field.metadata, *extra]
    kind = Annotated[(field.annotation, *metadata)] if metadata else field.annotation
    return Optional[kind], None  # noqa: UP045 (a runtime type expression)


_SETTINGS: dict[str, Any] = {name: _optional(name) for name in sorted(POLICY_TRAIN_SETTINGS)}
_SETTINGS["retention_days"] = (Annotated[int, Field(ge=1), INTEGRAL] | None, None)
PolicySettings = create_model(
    "PolicySettings", __base__=_SettingsModel, __doc__="A policy's own `train.*` settings and its retention; what is "
    "left out follows the config. Checked together on top of the config's trainer settings (400 "
    "`invalid_policy_settings`: `min_sessions` above `batch_sessions`, …).", **_SETTINGS)
"""The settings `POST /v1/policies` takes, typed as the config types them (config.POLICY_TRAIN_SETTINGS)."""


class CreatePolicyRequest(RequestModel):
    """A new named policy (docs/api.md, "Policies"): a line of LoRA versions on the shared base model."""

    name: str = Field(min_length=1, max_length=64, pattern=POLICY_NAME_PATTERN)
    training: Literal["lora"] = "lora"
    """`lora`, the only kind a policy may train; anything else is 400 `full_weight_policy`."""
    settings: PolicySettings = Field(default_factory=PolicySettings)  # type: ignore[valid-type]
    """Its own `train.*` settings (`lr`, `advantage`, …) and `retention_days`; the rest follow the config."""

    @field_validator("training", mode="before")
    @classmethod
    def _lora_only(cls, value: Any) -> Any:
        if value != "lora":
            raise refusal("full_weight_policy", f"A policy trains LoRA adapters only, not {value!r}: full-weight "
                          "training would change the base model under every other policy. Use training: lora.")
        return value


def _body_kind(value: Any) -> str:
    """A body with `name` creates a policy; any other publishes a checkpoint (and is checked as one)."""
    return "create" if isinstance(value, dict) and "name" in value else "publish"


PolicyPost = Annotated[Annotated[CreatePolicyRequest, Tag("create")] | Annotated[PublishRequest, Tag("publish")],
                       Discriminator(_body_kind)]


def _holds_checkpoint(path: Path, kind: Literal["full", "lora"]) -> bool:
    """Whether `path` is a checkpoint directory of `kind` at all (engines/publishing.py): safetensors files, or a
    PEFT adapter's config. Whether its tensors fit the served model is the publisher's check."""
    if not path.is_dir():
        return False
    return (path / ADAPTER_CONFIG).is_file() if kind == "lora" else any(path.glob("*.safetensors"))


@router.get("/v1/policies", responses=error_responses(404, described={404: "No such policy"}))
async def list_policies(gw: GatewayDep, caller: AdminDep, policy: PolicyQuery = None) -> dict[str, Any]:
    """The named policies (`policies`, only `policy`'s when asked) and the versions (`data`: every line's, each
    row with its `line`, or only `policy`'s), with the sessions waiting for the trainer (all, or `policy`'s), and
    `hints`: sentences for the user when a figure needs their attention (many sessions going stale)."""
    only = await scoped_policy(gw.policies, caller, policy)

    def read(db: Session) -> tuple[Sequence[PolicyLine], Sequence[Policy], int, int, dict[str, int]]:
        return (policy_lines.listed(db, name=only), queries.list_policies(db, line=only),
                leases.ready_count(db, policy=only), leases.leased_count(db, policy=only),
                leases.set_aside_counts(db, policy=only))

    lines, rows, ready, leased, set_aside = await gw.read(read)
    served = {line.name: line_version(gw.engine, line.name) for line in lines}
    train = gw.config.train
    own = lines[0].settings if only is not None and lines else {}  # a named policy may bound staleness itself
    hint = stale_hint(set_aside, sum(int((row.metrics or {}).get("sessions", 0)) for row in rows),
                      max_staleness=int(own.get("max_staleness", train.max_staleness)),
                      batch_sessions=int(own.get("batch_sessions", train.batch_sessions)))
    return {"object": "list", "served_version": gw.engine.version, "served_versions": served,
            "policies": [PolicyLinePublic.model_validate(line).model_dump(mode="json") for line in lines],
            # Sessions waiting for the trainer, claimed for a step in progress, and those it left in the
            # store unconsumed, by reason.
            "sessions": {"ready": ready, "leased": leased, "set_aside": set_aside},
            # What the figures mean for the user, in words, when something needs their attention.
            "hints": [hint] if hint else [],
            # Under canary promotion: the default line's (or `policy`'s) version on trial and its test's latest
            # figures, and every line's by policy.
            "promotion": {"mode": gw.config.promotion.mode,
                          "canary": gw.canaries.line(only or DEFAULT_POLICY).state(),
                          "canaries": {k: v for k, v in gw.canaries.states().items() if only in (None, k)}},
            "data": [row.model_dump(mode="json") for row in rows]}


@router.post("/v1/policies", responses=error_responses(
    404, 409, 502, described={404: "No checkpoint of that kind at that path on the gateway's machine",
                              409: "No publisher, a version not newer than the served one, or a canary on trial; "
                                   "a policy name taken, or more policies than engine.max_loras",
                              502: "The engine refused the checkpoint; it still serves the old version"}))
async def post_policy(gw: GatewayDep, body: PolicyPost, _: AdminDep) -> dict[str, Any]:
    """`{"name": …}` creates a named policy (201 in spirit, 200 as every route here answers); `{"version",
    "checkpoint", "kind"}` publishes a checkpoint, as a trainer in another process does."""
    if isinstance(body, CreatePolicyRequest):
        given = cast(BaseModel, body.settings).model_dump(exclude_unset=True)
        # null leaves a train setting to the config; for retention_days it means forever.
        settings = {k: v for k, v in given.items() if v is not None or k == "retention_days"}
        line = await gw.policies.create(body.name, body.training, settings)
        return {"created": True, **PolicyLinePublic.model_validate(line).model_dump(mode="json")}
    return await publish(gw, body)


async def publish(gw: Gateway, body: PublishRequest) -> dict[str, Any]:
    path = Path(body.checkpoint)
    # A path that names no checkpoint is the request's fault, like an unknown completion id: a 404 before the
    # publisher runs, never a 502 from it (the publisher read the gateway's own working directory as one).
    if not await asyncio.to_thread(_holds_checkpoint, path, body.kind):
        what = "a PEFT adapter (adapter_config.json)" if body.kind == "lora" else "*.safetensors files"
        raise APIError(404, f"No {body.kind} checkpoint at '{path}' on the gateway's machine: expected a directory "
                       f"with {what}.", code="checkpoint_not_found", param="checkpoint")
    try:
        await gw.publishing.publish(Checkpoint(body.version, path, body.kind, body.policy))
    except (PublishError, EngineError) as exc:
        raise APIError(502, f"Publishing version {body.version} failed; still serving version "
                       f"{line_version(gw.engine, body.policy)}: {exc}", code="publish_failed") from exc
    gw.metrics.policy_version.set(gw.engine.version)
    return {"version": line_version(gw.engine, body.policy), "published": True}


LineQuery = Annotated[str | None, Query(min_length=1, max_length=64, pattern=POLICY_NAME_PATTERN,
                                       description="The named policy whose canary it is (404 for an unknown one); "
                                                   "left out: the default line's.")]


class PromotionRequest(RequestModel):
    note: str = Field(default="", max_length=2000)
    """Why, kept with the decision."""


class PromotionResponse(BaseModel):
    version: int
    promotion: Literal["promoted", "rolled_back"]
    served_version: int
    """The version every new session of the line gets now."""


async def _decide_by_hand(gw: Gateway, version: int, outcome: Literal["promoted", "rolled_back"],
                          caller_owner: str | None, note: str, policy: str | None) -> PromotionResponse:
    line = policy or DEFAULT_POLICY
    if policy is not None:
        await gw.policies.require(policy, param="policy")
    canary = gw.canaries.line(line)
    trial = canary.trial
    if trial is None or trial.checkpoint.version != version:
        current = f"version {trial.checkpoint.version} is" if trial else "no version is"
        of = "" if line == DEFAULT_POLICY else f" of policy '{line}'"
        raise APIError(409, f"Version {version}{of} is not a canary on this gateway ({current} on trial); only a "
                       "canary can be promoted or rolled back by hand.", code="not_a_canary")
    figures = trial.latest.as_dict() if trial.latest else {}
    decision = {**figures, "by": "admin", "actor": caller_owner, "note": note,
                "reason": f"{outcome.replace('_', ' ')} by hand"}
    try:
        decided = await canary.decide(version, outcome, decision)
    except (PublishError, EngineError) as exc:
        raise APIError(502, f"Applying the decision on version {version} failed: {exc}", code="publish_failed") from exc
    if not decided:
        raise APIError(409, f"Version {version} was decided meanwhile.", code="not_a_canary")
    return PromotionResponse(version=version, promotion=outcome, served_version=line_version(gw.engine, line))


@router.post("/v1/policies/{version}/promote", response_model=PromotionResponse,
             responses=error_responses(401, 403, 404, 409, 502, described={404: "No such policy"}))
async def promote(gw: GatewayDep, version: int, caller: AdminDep, body: PromotionRequest | None = None,
                  policy: LineQuery = None) -> PromotionResponse:
    """Promote a canary now (of the named `policy`'s line, else the default's): every new session gets it (the
    test's figures so far are kept with it)."""
    return await _decide_by_hand(gw, version, "promoted", caller.owner, body.note if body else "", policy)


@router.post("/v1/policies/{version}/rollback", response_model=PromotionResponse,
             responses=error_responses(401, 403, 404, 409, 502, described={404: "No such policy"}))
async def rollback(gw: GatewayDep, version: int, caller: AdminDep, body: PromotionRequest | None = None,
                   policy: LineQuery = None) -> PromotionResponse:
    """Roll a canary back now (of the named `policy`'s line, else the default's): no session gets it again, its
    sessions are set aside (`rolled_back`), and the trainer continues from the line's incumbent."""
    return await _decide_by_hand(gw, version, "rolled_back", caller.owner, body.note if body else "", policy)
