"""Tables of the experience store.

A session is a tree of calls. Each call is one sampled choice: the prompt tokens it added to the
chain, the tokens the engine sampled, their logprobs and the policy version. `link` says how the
call joins its parent: it `extend`s the latest call of the session or `branch`es off an older one
(token-exact in both cases), or it starts a new segment and records why.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, Column, LargeBinary, UniqueConstraint
from sqlmodel import Field, SQLModel


def utcnow() -> datetime:
    return datetime.now(UTC)


CHAINED_LINKS = ("extend", "branch")
"""Links whose prompt is the parent's prompt + sampled tokens + a rendered tail, token for token."""


DEFAULT_POLICY = "default"
"""The policy line of every session that no key, path or model name binds elsewhere, and of every session
a store held before named policies existed (migration 0012)."""


class AgentSessionBase(SQLModel):
    id: str = Field(primary_key=True, max_length=256)
    group_id: str = Field(index=True, max_length=256)
    status: str = Field(default="open", max_length=16)
    """`open` until a reward marked `final` arrives."""
    policy: str = Field(default=DEFAULT_POLICY, index=True, max_length=64)
    """The named policy (`policy_lines.name`) the session belongs to, fixed by its first call: its rewards
    and corrections are that policy's, and keys bound to another policy cannot reach it."""


class AgentSession(AgentSessionBase, table=True):
    __tablename__ = "sessions"
    owner: str | None = Field(default=None, index=True, max_length=64)
    """Fingerprint of the API key that created the session; None when the gateway runs without keys."""
    created_at: datetime = Field(default_factory=utcnow, index=True)
    updated_at: datetime = Field(default_factory=utcnow, index=True)
    model: str | None = Field(default=None, index=True, max_length=256)
    """The model its first call asked for."""
    calls: int = Field(default=0, index=True)
    """Call rows recorded (one per sampled choice), kept by the writes that record them."""
    tokens: int = Field(default=0, index=True)
    """Tokens stored for the session: every call's new prompt tokens plus its sampled ones."""
    reward: float | None = Field(default=None, index=True)
    """The session's reward as the trainer sees it: `reward_override` if an admin set one, else the sum
    of every reward event (None before the first)."""
    reward_override: float | None = None
    """Set by an admin (`POST /v1/sessions/{id}/reward_override`): replaces the posted rewards, per-call
    ones included, for training."""
    excluded: bool = Field(default=False)
    """Kept out of training by an admin: no trainer claims it until it is included again."""
    lease_owner: str | None = Field(default=None, max_length=64)
    """The trainer that has claimed this session for a step, until `lease_until`."""
    lease_until: datetime | None = None
    policy_version: int | None = Field(default=None, index=True)
    """The version its first call was served by. Under canary promotion every call of the session is
    served by it (while that version is served), and the canary's test compares sessions by it."""
    trained_version: int | None = Field(default=None, index=True)
    """The policy version whose training step consumed this session (None: not consumed yet)."""
    skip_reason: str | None = Field(default=None, max_length=32)
    """Why the online trainer set it aside (`stale`, `zero_variance`, `no_samples`): it stays
    unconsumed (`trained_version` None) for offline algorithms and export. (Stores written by 0.1 have
    the reason together with a `trained_version`.)"""
    redactions: dict[str, int] | None = Field(default=None, sa_column=Column(JSON))
    """What redaction found in the session's stored calls, by type (`{"EMAIL": 2}`); None: nothing."""
    purged: str | None = Field(default=None, max_length=16)
    """Why its content is gone: `retention` (older than `store.retention_days`, store/retention.py) or `deleted`
    (an admin's `DELETE /v1/sessions/{id}`, an erasure request). A purged session keeps its row, counts,
    rewards and versions, and is never claimed for training or exported."""
    purged_at: datetime | None = None
    """When its content was last cleared; a call recorded after it (an agent still using the session id)
    is cleared by a later purge."""


class AgentSessionPublic(AgentSessionBase):
    created_at: datetime
    updated_at: datetime
    model: str | None = None
    calls: int = 0
    tokens: int = 0
    reward: float | None = None
    reward_override: float | None = None
    excluded: bool = False
    policy_version: int | None = None
    trained_version: int | None = None
    skip_reason: str | None = None
    redactions: dict[str, int] | None = None
    purged: str | None = None
    purged_at: datetime | None = None


class CallBase(SQLModel):
    id: str = Field(primary_key=True, max_length=128)
    completion_id: str = Field(index=True, max_length=128)
    choice_index: int = 0
    session_id: str = Field(index=True, foreign_key="sessions.id", max_length=256)
    group_id: str = Field(max_length=256)
    seq: int = 0
    """Order of the call within its session."""
    parent_id: str | None = Field(default=None, max_length=128)
    link: str = Field(max_length=32)
    """`start`, `extend`, `branch`, or the reason a new segment began (`prefix_changed`, ...)."""
    model: str = Field(max_length=256)
    policy_version: int = 0
    finish_reason: str | None = Field(default=None, max_length=32)
    prefix_len: int = 0
    """Tokens of the prompt taken from the parent's chain rather than stored on this row."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0
    created_at: datetime = Field(default_factory=utcnow)


PURGED_STATE = "purged"
"""`state_hash` of a call whose content a purge cleared: no request hashes to it, so nothing extends it."""


class Call(CallBase, table=True):
    __tablename__ = "calls"
    owner: str | None = Field(default=None, max_length=64)
    state_hash: str = Field(index=True, max_length=64)
    """Hash of the tools, request messages and this reply: a later request whose history hashes the
    same extends this call."""
    prompt_ids: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    completion_ids: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    completion_logprobs: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    messages: list[dict[str, Any]] = Field(sa_column=Column(JSON, nullable=False))
    """The request's messages after the first `messages_inherited` (store/messages.py rebuilds them all)."""
    messages_inherited: int = 0
    """Leading request messages not stored on this row because they are the first ones of the parent
    call's (`parent_id`): a 50-turn session stores its history once, not 50 times."""
    response_message: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    request_params: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    redactions: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    """What redaction found in this call (`counts` by type) and, under `gateway.redaction: redact`, the token
    ranges it masked: `prompt` in `prompt_ids`, `completion` in `completion_ids`, as [start, end) pairs.
    Masked ids hold a filler id and are out of the loss (docs/architecture.md, "Redaction")."""


class CallPublic(CallBase):
    response_message: dict[str, Any]
    redactions: dict[str, Any] | None = None


class RewardBase(SQLModel):
    session_id: str = Field(index=True, max_length=256)
    call_id: str | None = Field(default=None, max_length=128)
    value: float
    components: dict[str, float] | None = Field(default=None, sa_column=Column(JSON))
    final: bool = False
    idempotency_key: str | None = Field(default=None, max_length=256)


class Reward(RewardBase, table=True):
    __tablename__ = "rewards"
    __table_args__ = (UniqueConstraint("session_id", "idempotency_key", name="uq_reward_idempotency"),)
    id: int | None = Field(default=None, primary_key=True)
    created_at: datetime = Field(default_factory=utcnow)


class RewardPublic(RewardBase):
    id: int
    created_at: datetime


class Policy(SQLModel, table=True):
    """One version of one policy line: key (line, version), each line numbering its own from 0, the base model."""

    __tablename__ = "policies"
    line: str = Field(default=DEFAULT_POLICY, primary_key=True, max_length=64)
    """The named policy (`policy_lines.name`) whose line this version continues."""
    version: int = Field(primary_key=True)
    created_at: datetime = Field(default_factory=utcnow)
    checkpoint: str | None = Field(default=None, max_length=1024)
    """Directory of the weights; None for the base model."""
    kind: str = Field(default="base", max_length=16)
    """`base`, `full` or `lora`."""
    published_at: datetime | None = None
    publish_error: str | None = None
    metrics: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    """Training-step figures: loss, reward mean, samples used and skipped, tokens/s, ..."""
    promotion: str | None = Field(default=None, max_length=16)
    """None until published; then `immediate` (served to everyone at once), or under canary promotion
    `canary` (serving a share of new sessions), `promoted` or `rolled_back`."""
    canary_since: datetime | None = None
    """When it began serving as a canary: incumbent sessions from then on are its comparison arm."""
    decided_at: datetime | None = None
    decision: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    """The canary decision with its numbers (proxy/sequential.py), or who promoted or rolled it back."""
    first_call_at: datetime | None = None
    """When a gateway first recorded a call this version served: after `published_at`, the last part of
    the time from a trained batch to a better reply."""
    probes: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    """The publish probe by replica URL (engines/probe.py): `ok`, `mean_diff`, `max_diff`, `tolerance`.
    A replica whose probe failed was taken out of routing and does not serve this version."""


class PolicyLineBase(SQLModel):
    """A named policy: one line of LoRA versions on the shared base model, with its own sessions and training
    settings (docs/architecture.md, decision 13). Not to be confused with `Policy`, whose rows are the
    *versions* a trainer published, each of one line (`Policy.line`)."""

    name: str = Field(primary_key=True, max_length=64)
    training: str = Field(default="lora", max_length=16)
    """How the line trains: `lora` only; full-weight training would move the base model every other policy
    shares, and is refused when a policy is created."""
    settings: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    """Overrides of the `train.*` settings for this line (`{"lr": 1e-5, "advantage": "grpo"}`), and its
    `retention_days`; what is left out follows the config."""


class PolicyLine(PolicyLineBase, table=True):
    __tablename__ = "policy_lines"
    created_at: datetime = Field(default_factory=utcnow)
    source: str = Field(default="api", max_length=16)
    """Where it was declared: `api` (`POST /v1/policies`), `config` (the config file's `policies`), or
    `builtin` (the default line, present in every store)."""


class PolicyLinePublic(PolicyLineBase):
    created_at: datetime
    source: str


class GenerationHold(SQLModel, table=True):
    """A hold on new generations (a `sync`-mode trainer's step) that every gateway process on this store
    obeys; it lapses by itself at `expires_at`, so a holder that dies cannot stall the agents."""

    __tablename__ = "generation_holds"
    holder: str = Field(primary_key=True, max_length=128)
    expires_at: datetime


class GatewayProcess(SQLModel, table=True):
    """A gateway process on this store, alive while its heartbeat is recent: a full-weight reload waits
    for every live process to stop sending to the replica being reloaded (store/replica_states.py)."""

    __tablename__ = "gateway_processes"
    id: str = Field(primary_key=True, max_length=128)
    """host:pid:random, new for every process start."""
    heartbeat_at: datetime


class ReplicaState(SQLModel, table=True):
    """The weights a vLLM replica holds, as the store records them for every gateway process in front of
    it, and the full-weight reload under way, if any (claimed by one process under a lease)."""

    __tablename__ = "replica_states"
    url: str = Field(primary_key=True, max_length=512)
    version: int = 0
    """The version its weights are: what every process labels its calls with."""
    checkpoint: str | None = Field(default=None, max_length=1024)
    """Where those weights came from (None: the server's own model)."""
    epoch: int = 0
    """Counts reload claims: acknowledgements name the claim they answer."""
    reloading_to: int | None = None
    """The version being loaded while a reload is under way: no process sends calls to it meanwhile."""
    owner: str | None = Field(default=None, max_length=128)
    """The process doing the reload."""
    expires_at: datetime | None = None
    """The reload's lease: a claim its owner stops renewing (the process died) lapses here."""
    failure: str | None = Field(default=None, max_length=2048)
    """Why the last reload failed (the replica then holds `version` still, or is out)."""
    updated_at: datetime = Field(default_factory=utcnow)


class ReplicaAck(SQLModel, table=True):
    """A gateway process's word that it sends nothing to a replica under the reload claim `epoch`."""

    __tablename__ = "replica_acks"
    url: str = Field(primary_key=True, max_length=512)
    epoch: int = Field(primary_key=True)
    process: str = Field(primary_key=True, max_length=128)


SESSION_ACTIONS = ("exclude", "include", "reward_override", "clear_reward_override", "no_train")

NO_TRAIN_REASONS = ("no_train_key", "no_train_header", "no_train_admin")
"""A session's `skip_reason` (with `excluded` set) when it must never be trained on or exported for
training: its key's setting, its request's `X-Train: no`, an admin's word. No admin can include it again."""


class SessionActionBase(SQLModel):
    """One correction an admin made to a session, kept for good: who, when, what it was and became."""

    session_id: str = Field(index=True, max_length=256)
    action: str = Field(max_length=32)
    """One of `SESSION_ACTIONS`."""
    actor: str | None = Field(default=None, max_length=64)
    """Fingerprint of the key that made it; None when the gateway runs without keys."""
    note: str = ""
    old_value: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    new_value: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))


class SessionAction(SessionActionBase, table=True):
    __tablename__ = "session_actions"
    id: int | None = Field(default=None, primary_key=True)
    created_at: datetime = Field(default_factory=utcnow)


class SessionActionPublic(SessionActionBase):
    id: int
    created_at: datetime


AUDIT_ACTIONS = ("export", "correction", "no_train", "purge", "delete")
"""What the audit log (`GET /v1/audit`) lists. Corrections and no_train come from `session_actions`, which
keeps them already (with their notes and values); the others from `audit_log` (store/audit.py)."""


class AuditEntryBase(SQLModel):
    """Who exported, purged or deleted what, and when: one row per action, never changed."""

    action: str = Field(index=True, max_length=16)
    """`export`, `purge` or `delete` (corrections stay in `session_actions`)."""
    actor: str | None = Field(default=None, max_length=64)
    """Fingerprint of the key that acted, as corrections name it (None: a gateway without keys); `retention`
    for the gateway's scheduled purge, `cli` for a command (`tracetrain db purge`, `tracetrain export`)."""
    session_id: str | None = Field(default=None, index=True, max_length=256)
    """The one session it concerned (a delete); None when it concerned many (an export, a purge)."""
    sessions: int = 0
    """How many sessions it concerned."""
    detail: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    """What else says what was done: an erasure's `reason`, a purge's `cutoffs`, an export's `format`."""


class AuditEntry(AuditEntryBase, table=True):
    __tablename__ = "audit_log"
    id: int | None = Field(default=None, primary_key=True)
    created_at: datetime = Field(default_factory=utcnow, index=True)
