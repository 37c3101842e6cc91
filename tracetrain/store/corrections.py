"""An admin's corrections to a session: keep it out of training (and let it back in), mark it never
to be trained on (consent: also by its key or request), override its reward (and clear the override).
Each one changes the session row and adds a `SessionAction` in the same transaction, so the audit trail
and what the trainer sees never disagree."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlmodel import Session, col, func, select

from tracetrain.store.models import NO_TRAIN_REASONS, AgentSession, Reward, SessionAction


def _record(db: Session, session: AgentSession, *, action: str, actor: str | None, note: str,
            old: dict[str, Any], new: dict[str, Any]) -> SessionAction:
    entry = SessionAction(session_id=session.id, action=action, actor=actor, note=note, old_value=old, new_value=new)
    db.add(session)
    db.add(entry)
    db.flush()
    return entry


def set_excluded(db: Session, *, session_id: str, excluded: bool, actor: str | None, note: str = "",
                 ) -> tuple[AgentSession, SessionAction | None] | None:
    """Exclude the session from training, or include it again; None if it does not exist, no action when
    it is not for training (`NO_TRAIN_REASONS`) and cannot be included. A session a trainer already
    learned from keeps its `trained_version`: exclusion only stops future claims."""
    session = db.get(AgentSession, session_id, with_for_update=True)
    if session is None:
        return None
    if not excluded and session.skip_reason in NO_TRAIN_REASONS:
        return session, None  # not for training: no one may let it back in
    old = {"excluded": session.excluded}
    session.excluded = excluded
    entry = _record(db, session, action="exclude" if excluded else "include", actor=actor, note=note,
                    old=old, new={"excluded": excluded})
    return session, entry


def mark_no_train(db: Session, *, session_id: str, reason: str, actor: str | None, note: str = "",
                  ) -> tuple[AgentSession, SessionAction | None] | None:
    """Never train on the session or export it for training (`reason`, one of `NO_TRAIN_REASONS`); it stays
    served and kept. None if it does not exist; no action when it is already not for training."""
    session = db.get(AgentSession, session_id, with_for_update=True)
    if session is None:
        return None
    if session.skip_reason in NO_TRAIN_REASONS:
        return session, None
    old = {"excluded": session.excluded, "skip_reason": session.skip_reason}
    session.excluded, session.skip_reason = True, reason
    entry = _record(db, session, action="no_train", actor=actor, note=note, old=old,
                    new={"excluded": True, "skip_reason": reason})
    return session, entry


def override_reward(db: Session, *, session_id: str, reward: float, actor: str | None, note: str = "",
                    ) -> tuple[AgentSession, SessionAction] | None:
    """Make `reward` the session's reward for training, in place of its posted rewards; None if the
    session does not exist. Reward events posted later do not change it."""
    session = db.get(AgentSession, session_id, with_for_update=True)
    if session is None:
        return None
    old = {"reward": session.reward, "reward_override": session.reward_override}
    session.reward_override = session.reward = reward
    entry = _record(db, session, action="reward_override", actor=actor, note=note, old=old,
                    new={"reward": reward, "reward_override": reward})
    return session, entry


def clear_reward_override(db: Session, *, session_id: str, actor: str | None, note: str = "",
                          ) -> tuple[AgentSession, SessionAction | None] | None:
    """Drop the session's reward override: its reward for training is the sum of its posted rewards again
    (None if it has none), as if no override had been made. None if the session does not exist;
    (session, None) if it has no override: nothing changes and nothing is recorded."""
    session = db.get(AgentSession, session_id, with_for_update=True)
    if session is None:
        return None
    if session.reward_override is None:
        return session, None
    # Summed under the session row's lock: a reward posted meanwhile (queries.add_reward updates this
    # row) is either in the sum or adds itself to it once the override is gone.
    posted = db.exec(select(func.sum(Reward.value)).where(Reward.session_id == session_id)).one()
    old = {"reward": session.reward, "reward_override": session.reward_override}
    session.reward_override = None
    session.reward = None if posted is None else float(posted)
    entry = _record(db, session, action="clear_reward_override", actor=actor, note=note, old=old,
                    new={"reward": session.reward, "reward_override": None})
    return session, entry


def session_actions(db: Session, *, session_id: str) -> Sequence[SessionAction]:
    """The session's corrections, oldest first."""
    query = select(SessionAction).where(SessionAction.session_id == session_id).order_by(col(SessionAction.id))
    return db.exec(query).all()
