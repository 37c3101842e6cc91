"""Request and response models of the console's JSON API: who the caller is, the overview, the session
list, an admin's corrections to a session (exclude, include, reward override) and their audit trail,
and capture quality."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tracetrain.store.models import AgentSessionPublic, SessionActionPublic

MAX_NOTE = 4000


class NoteRequest(BaseModel):
    """Optional body of exclude and include: why."""

    model_config = ConfigDict(extra="forbid")
    note: str = Field(default="", max_length=MAX_NOTE)


class RewardOverrideRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: Annotated[float, Field(strict=True, allow_inf_nan=False)]
    """The reward the trainer uses for this session from now on, in place of the posted ones."""
    note: str = Field(max_length=MAX_NOTE)


class CorrectionResponse(BaseModel):
    """The session's state after an admin's action, and the action as stored."""

    session_id: str
    excluded: bool
    reward: float | None
    """The reward the trainer uses: the override if set, else the sum of the posted rewards."""
    reward_override: float | None
    trained_version: int | None
    """Set when a trainer already learned from the session (before this action): a correction changes
    only what is trained from now on."""
    action: SessionActionPublic


class ActionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionActionPublic]


class SessionSummary(AgentSessionPublic):
    """A row of the session list."""

    policy_version_min: int | None = None
    """Oldest policy version among the session's calls (None: no calls)."""
    policy_version_max: int | None = None


class SessionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionSummary]
    total: int
    """Sessions matching the filters, on every page."""
    has_more: bool
    limit: int
    offset: int


class CaptureRow(BaseModel):
    model: str | None
    owner: str | None
    """Fingerprint of the API key (None: a gateway without keys)."""
    calls: int
    chained: int
    """Calls that extended their session's token chain (or branched off it), token for token."""
    chained_share: float | None
    """`chained` over the calls that had an earlier call to extend (not a session's first)."""
    segment_starts: dict[str, int]
    """Calls that began a new token segment, by reason (`start`, `prefix_changed`, ...)."""
    set_aside: dict[str, int]
    """Finished sessions the trainer did not consume, by reason (`stale`, `zero_variance`, `no_samples`,
    `excluded`)."""


class CaptureStats(BaseModel):
    object: Literal["capture_stats"] = "capture_stats"
    total: CaptureRow
    """Every model and key together."""
    data: list[CaptureRow]
    """Per model and API key owner."""


class WhoAmI(BaseModel):
    """Who the caller is, as the gateway sees its key: what the console shows depends on it."""

    owner: str | None
    """Fingerprint of the caller's key (None: a gateway without keys)."""
    admin: bool
    keys_required: bool
    """False on a gateway without keys (loopback only): every caller is an anonymous admin."""


class TrafficCounters(BaseModel):
    """Counters since this gateway process started (its Prometheus metrics): a client takes the rate
    between two readings and their `time`."""

    requests: int
    """Generation requests answered, every status."""
    failed_requests: int
    """Those answered with an error status."""
    prompt_tokens: int
    completion_tokens: int
    sessions_created: int
    rewards: int
    """Reward events stored."""


class TrainerState(BaseModel):
    state: Literal["held", "stepping", "waiting"]
    """`held`: new generations wait at the gate (a `sync`-mode training step or a weight reload);
    `stepping`: a trainer has claimed sessions for a step it is gathering or training; `waiting`: no
    claim runs, `ready` sessions wait for a trainer."""
    ready: int
    """Finished sessions no trainer has claimed yet."""
    leased: int
    """Sessions claimed for a step in progress."""
    holders: list[str]
    """Who holds new generations now (`train`, `publish`, `remote:<trainer>`)."""
    last_step_at: datetime | None
    """When the newest trained version was recorded (None: none yet)."""


class LastPublish(BaseModel):
    version: int
    published_at: datetime | None
    """None when it failed (see `error`)."""
    seconds: float | None
    """How long handing the checkpoint to the engine took."""
    error: str | None


class Overview(BaseModel):
    object: Literal["overview"] = "overview"
    time: float
    """The gateway's clock (Unix seconds) when the counters were read."""
    counters: TrafficCounters
    store_queue_depth: int
    """Writes waiting for the group-commit writer."""
    served_version: int
    sessions: dict[str, int]
    """Stored sessions by status (`open`, `final`)."""
    trainer: TrainerState
    last_publish: LastPublish | None
    """The newest trained version's publish (None: no version trained yet)."""
