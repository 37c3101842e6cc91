"""Export trajectories as rows that TRL or verl can read (JSONL or Parquet).

One row per trajectory segment: `input_ids`, `loss_mask` (1 on sampled tokens), behaviour
`logprobs`, `policy_versions`, the session's summed `reward`, and the chat `messages`/`completion`
of its last call for text-based trainers.

Sessions not for training (`NO_TRAIN_REASONS`) and sessions whose content was purged are never exported.
Every export is recorded in the audit log (store/audit.py) before its first row.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, func, or_, select

from tracetrain.store import audit, queries
from tracetrain.store.messages import full_messages
from tracetrain.store.models import NO_TRAIN_REASONS, AgentSession, AuditEntry
from tracetrain.store.trajectory import session_trajectories


def session_rows(db: Session, session_id: str) -> Iterator[dict[str, Any]]:
    session = queries.get_session(db, session_id=session_id)
    if session is None or session.skip_reason in NO_TRAIN_REASONS or session.purged is not None:
        return  # kept for audit (or its content is gone), never exported for training
    calls = queries.session_calls(db, session_id=session_id)
    by_id = {call.id: call for call in calls}
    rewards = queries.session_rewards(db, session_id=session_id)
    # An admin's override is the session's reward for every trainer, offline ones included.
    total = sum(r.value for r in rewards) if session.reward_override is None else session.reward_override
    for t_index, trajectory in enumerate(session_trajectories(calls)):
        for s_index, segment in enumerate(trajectory["segments"]):
            last = by_id[segment["call_ids"][-1]]
            yield {
                "session_id": session_id, "group_id": session.group_id, "trajectory": t_index,
                "segment": s_index, "segment_reason": segment["reason"], "call_ids": segment["call_ids"],
                "input_ids": segment["token_ids"], "loss_mask": segment["loss_mask"],
                "logprobs": segment["logprobs"], "policy_versions": segment["policy_versions"],
                "reward": total, "final": session.status == "final",
                # Which step learned from it, or why the online trainer left it (stale, zero_variance, ...).
                "trained_version": session.trained_version, "unused_reason": session.skip_reason,
                "excluded": session.excluded,
                "prompt": full_messages(last, by_id), "completion": [last.response_message],
            }


def iter_rows(db: Engine, *, policy: str | None = None) -> Iterator[dict[str, Any]]:
    """Every exportable segment; only one named policy's sessions with `policy`."""
    with Session(db) as s:
        for session_id in queries.all_session_ids(s, policy=policy):
            yield from session_rows(s, session_id)


def record_export(db: Session, *, actor: str | None, fmt: str, policy: str | None = None) -> AuditEntry:
    """The audit entry of an export about to run: who, and how many sessions it may hold (a writer op)."""
    exportable = select(func.count()).select_from(AgentSession).where(
        col(AgentSession.purged).is_(None),
        or_(col(AgentSession.skip_reason).is_(None), col(AgentSession.skip_reason).not_in(NO_TRAIN_REASONS)))
    if policy is not None:
        exportable = exportable.where(col(AgentSession.policy) == policy)
    detail: dict[str, Any] = {"format": fmt} if policy is None else {"format": fmt, "policy": policy}
    return audit.record(db, action="export", actor=actor, sessions=int(db.exec(exportable).one()), detail=detail)


def export(db: Engine, out: Path, fmt: str, *, actor: str | None = "cli", policy: str | None = None) -> int:
    """Write every trajectory segment to `out` (only one named policy's with `policy`), recorded in the audit
    log as `actor`'s; returns the number of rows."""
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"unknown export format {fmt!r}: use jsonl or parquet")
    with Session(db) as s:
        record_export(s, actor=actor, fmt=fmt, policy=policy)
        s.commit()
    rows = 0
    if fmt == "jsonl":
        with out.open("wb") as fh:
            for row in iter_rows(db, policy=policy):
                fh.write(orjson.dumps(row) + b"\n")
                rows += 1
        return rows
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table_rows = [{**row, "prompt": orjson.dumps(row["prompt"]).decode(),
                       "completion": orjson.dumps(row["completion"]).decode()} for row in iter_rows(db, policy=policy)]
        pq.write_table(pa.Table.from_pylist(table_rows), out)
        return len(table_rows)
    raise ValueError(f"unknown export format {fmt!r}: use jsonl or parquet")
