"""Each call stores only the request messages it added; reading rebuilds exactly what was sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openai import OpenAI
from sqlmodel import Session

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.engines.transformers_engine import TransformersEngine
from tracetrain.store import export, queries
from tracetrain.store.db import open_db
from tracetrain.store.messages import call_messages, full_messages


def _turns(gateway: RunningGateway, session: str, history: list[dict[str, Any]], turns: int,
           sent: list[list[dict[str, Any]]]) -> None:
    client = OpenAI(base_url=gateway.v1(session), api_key="unused")
    for turn in range(turns):
        history.append({"role": "user", "content": f"turn {len(sent)}: what next?"})
        sent.append([dict(m) for m in history])
        reply = client.chat.completions.create(model="tiny", messages=history, max_tokens=3, temperature=1.0,  # type: ignore[arg-type]
                                               seed=turn)
        history.append(reply.choices[0].message.model_dump(exclude_none=True))


def test_a_long_session_stores_its_history_once_and_reads_back_what_was_sent(
        tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'gw.db'}"
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are terse. " * 20}]
    sent: list[list[dict[str, Any]]] = []
    first = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, db_url)
    try:
        _turns(first, "long", history, 6, sent)
    finally:
        first.stop()
    # a restarted gateway has nothing cached: it reads the parent's messages back from the store
    second = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, db_url)
    try:
        _turns(second, "long", history, 4, sent)
        history[1] = {"role": "user", "content": "an edited first question"}  # history rewritten: no shared tail
        history.append({"role": "user", "content": "and now?"})
        sent.append([dict(m) for m in history])
        OpenAI(base_url=second.v1("long"), api_key="unused").chat.completions.create(
            model="tiny", messages=history, max_tokens=3)  # type: ignore[arg-type]
    finally:
        second.stop()

    db = open_db(db_url)
    with Session(db) as s:
        calls = list(queries.session_calls(s, session_id="long"))
        by_id = {c.id: c for c in calls}
        assert [full_messages(c, by_id) for c in calls] == sent
        assert call_messages(s, call=calls[-2]) == sent[-2]
    stored = [len(c.messages) for c in calls]
    assert stored[0] == 2 and stored[1:-1] == [2] * (len(sent) - 2), "after the first: the reply echoed, a question"
    # rewritten history starts a new segment with no parent call: its messages are stored whole
    assert (calls[-1].messages_inherited, len(calls[-1].messages)) == (0, len(sent[-1]))
    (row,) = [r for r in export.iter_rows(db) if r["call_ids"][-1] == calls[-2].id]
    assert row["prompt"] == sent[-2]
