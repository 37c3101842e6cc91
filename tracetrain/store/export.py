"""Export trajectories as rows that TRL or verl can read (JSONL or Parquet).

One row per trajectory segment: `input_ids`, `loss_mask` (1 on sampled tokens), behaviour
`logprobs`, `policy_versions`, the session's summed `reward`, and the chat `messages`/`completion`
of its last call for text-based trainers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy.engine import Engine
from sqlmodel import Session

from tracetrain.store import queries
from tracetrain.store.messages import full_messages
from tracetrain.store.models import NO_TRAIN_REASONS
from tracetrain.store.trajectory import session_trajectories


def session_rows(db: Session, session_id: str) -> Iterator[dict[str, Any]]:
    session = queries.get_session(db, session_id=session_id)
    if session is None or session.skip_reason in NO_TRAIN_REASONS:
        return  # kept for audit, never exported for training
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


def iter_rows(engine: Engine) -> Iterator[dict[str, Any]]:
    with Session(engine) as db:
        for session_id in queries.all_session_ids(db):
            yield from session_rows(db, session_id)


def export(engine: Engine, out: Path, fmt: str) -> int:
    """Write every trajectory segment to `out`; returns the number of rows."""
    rows = 0
    if fmt == "jsonl":
        with out.open("wb") as fh:
            for row in iter_rows(engine):
                fh.write(orjson.dumps(row) + b"\n")
                rows += 1
        return rows
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table_rows = [{**row, "prompt": orjson.dumps(row["prompt"]).decode(),
                       "completion": orjson.dumps(row["completion"]).decode()} for row in iter_rows(engine)]
        pq.write_table(pa.Table.from_pylist(table_rows), out)
        return len(table_rows)
    raise ValueError(f"unknown export format {fmt!r}: use jsonl or parquet")
