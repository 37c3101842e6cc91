"""Redaction over real HTTP, for every API, streamed and not: the agent gets the real reply; the store holds
placeholders, and filler ids (out of the loss) where tokens spelled a secret, in requests, replies, tool
arguments and tool results; the token chain stays exact; no original reaches the database file (WAL
included) or the logs."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from tests.support.scripted import ScriptedEngine
from tests.support.servers import RunningGateway, start_gateway

EMAIL, CARD, KEY = "ann.lee@example.com", "4111 1111 1111 1111", "sk-proj-Ab3dEf6hIj9kLmN0pQrStUvWxYz12345"
PHONE, IP, IBAN = "+1 415 555 0132", "203.0.113.42", "DE89 3704 0044 0532 0130 00"
SECRETS = (EMAIL, CARD, KEY, PHONE, IP, IBAN)
PAY = {"type": "function", "function": {"name": "pay", "parameters": {"type": "object"}}}
CALL_TEXT = '<tool_call>\n{"name": "pay", "arguments": {"card": "' + CARD + '", "ip": "' + IP + '"}}\n</tool_call>'


@pytest.fixture
def scripted(tiny_model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[RunningGateway]:
    caplog.set_level(logging.DEBUG)
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(str(tiny_model_path)), "tiny")
    running = start_gateway(engine, tiny_model_path, f"sqlite:///{tmp_path / 'red.db'}")
    yield running
    running.stop()
    _assert_nothing_kept(tmp_path, caplog.text)


def _assert_nothing_kept(store_dir: Path, logs: str) -> None:
    """No original value in the store's files (the database, its WAL and shared memory) or the logs."""
    for path in store_dir.glob("red.db*"):
        data = path.read_bytes()
        for secret in SECRETS:
            assert secret.encode() not in data, (secret, path.name)
    assert not any(secret in logs for secret in SECRETS)


def _engine(gw: RunningGateway) -> ScriptedEngine:
    engine = gw.gateway.engine
    assert isinstance(engine, ScriptedEngine)
    return engine


def _session(gw: RunningGateway, session: str) -> dict[str, Any]:
    return httpx.get(f"{gw.url}/v1/sessions/{session}").json()  # type: ignore[no-any-return]


def _segments(gw: RunningGateway, session: str) -> list[dict[str, Any]]:
    found = httpx.get(f"{gw.url}/v1/sessions/{session}/trajectory").json()["trajectories"]
    return [seg for trajectory in found for seg in trajectory["segments"]]


def _post(gw: RunningGateway, path: str, body: dict[str, Any], session: str) -> str:
    """The response body as the client gets it (a stream's events joined)."""
    response = httpx.post(f"{gw.url}/s/{session}{path}", json=body, headers={"anthropic-version": "2023-06-01"},
                          timeout=60)
    assert response.status_code == 200, response.text
    return response.text


def _assert_masked_exactly(gw: RunningGateway, session: str) -> dict[str, Any]:
    """One segment: the engine's last prompt + sample, but filler ids where a secret was, none of which are in
    the loss, and the decoded store spelling no secret."""
    engine = _engine(gw)
    (segment,) = _segments(gw, session)
    seen = engine.prompts[-1] + engine.samples[-1]
    assert len(segment["token_ids"]) == len(seen)
    changed = [i for i, (a, b) in enumerate(zip(segment["token_ids"], seen, strict=True)) if a != b]
    assert changed, "a secret's tokens are masked"
    filler = gw.gateway.renderer.tokenizer.unk_token_id
    assert all(segment["token_ids"][i] == filler and segment["loss_mask"][i] == 0 for i in changed)
    text = gw.gateway.renderer.tokenizer.decode(segment["token_ids"])
    assert not any(secret in text for secret in SECRETS)
    return segment


@pytest.mark.parametrize("stream", [False, True])
def test_chat_keeps_placeholders_masks_tokens_and_extends_the_chain(scripted: RunningGateway, stream: bool) -> None:
    engine = _engine(scripted)
    engine.replies += [CALL_TEXT, f"Paid. A receipt goes to {EMAIL}, call {PHONE} with questions."]
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Pay with my card, I am {EMAIL}."}]
    body = {"model": "tiny", "messages": messages, "tools": [PAY], "stream": stream}
    first = _post(scripted, "/v1/chat/completions", body, "chat")
    assert CARD in first.replace("\\", ""), "the agent gets the real tool call"
    reply = json.loads(first)["choices"][0]["message"] if not stream else {
        "role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "pay", "arguments": json.dumps({"card": CARD, "ip": IP})}}]}
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"],
                         "content": f"ok, charged to IBAN {IBAN}, key {KEY}"}]
    second = _post(scripted, "/v1/chat/completions", {**body, "messages": messages}, "chat")
    assert EMAIL in second and PHONE in second

    segment = _assert_masked_exactly(scripted, "chat")
    assert sum(segment["loss_mask"]) < len(engine.samples[0]) + len(engine.samples[1])
    session = _session(scripted, "chat")
    assert [c["link"] for c in session["calls"]] == ["start", "extend"]
    # Counted as stored: the second call's row keeps the echoed tool call (its request's new messages) again.
    assert session["redactions"] == {"EMAIL": 2, "CARD": 2, "IP": 2, "IBAN": 1, "SECRET": 1, "PHONE": 1}
    stored = json.dumps([session["calls"][1]["response_message"], session["calls"][0]["response_message"]])
    assert "[EMAIL]" in stored and "[CARD]" in stored and "[PHONE]" in stored


def test_a_chain_whose_secrets_are_gone_or_differ_starts_a_redacted_segment(scripted: RunningGateway) -> None:
    engine = _engine(scripted)
    engine.replies += ["Noted.", "Noted again.", "And again."]
    first = [{"role": "user", "content": f"I am {EMAIL}"}]
    _post(scripted, "/v1/chat/completions", {"model": "tiny", "messages": first}, "s")
    history = [*first, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "ok"}]
    other = [{"role": "user", "content": "I am bob@example.org"}, *history[1:]]
    _post(scripted, "/v1/chat/completions", {"model": "tiny", "messages": other}, "s")  # same placeholders
    scripted.gateway.sessions._chains.clear()  # a restart: only the store's masked ids are left
    _post(scripted, "/v1/chat/completions", {"model": "tiny", "messages": history}, "s")
    assert [c["link"] for c in _session(scripted, "s")["calls"]] == ["start", "redacted", "redacted"]
    assert engine.prompts[2] == scripted.gateway.renderer.render(history, None, generation=True)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_messages_and_completions_are_redacted_alike(scripted: RunningGateway, stream: bool) -> None:
    engine = _engine(scripted)
    engine.replies += [CALL_TEXT, f"Mail {EMAIL}.", f"Reach {PHONE}."]
    items = [{"role": "user", "content": f"key {KEY}"},
             {"type": "function_call", "call_id": "c1", "name": "pay", "arguments": json.dumps({"iban": IBAN})},
             {"type": "function_call_output", "call_id": "c1", "output": f"done for {EMAIL}"}]
    served = _post(scripted, "/v1/responses", {"model": "tiny", "input": items, "tools": [
        {"type": "function", "name": "pay", "parameters": {"type": "object"}}], "stream": stream}, "resp")
    assert CARD in served.replace("\\", "")
    blocks = [{"role": "user", "content": f"card {CARD}"},
              {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01A", "name": "pay",
                                                 "input": {"ip": IP}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01A", "content": KEY}]}]
    served = _post(scripted, "/v1/messages", {"model": "tiny", "max_tokens": 64, "messages": blocks,
                                              "stream": stream}, "msg")
    assert EMAIL in served
    served = _post(scripted, "/v1/completions", {"model": "tiny", "prompt": f"IBAN {IBAN}, mail {EMAIL}:",
                                                 "max_tokens": 64, "stream": stream}, "cmpl")
    assert PHONE in served
    for session in ("resp", "msg", "cmpl"):
        _assert_masked_exactly(scripted, session) if session == "cmpl" else None
        record = _session(scripted, session)
        assert record["redactions"], session
        assert not any(secret in json.dumps(record) for secret in SECRETS)
        (segment,) = _segments(scripted, session)
        assert scripted.gateway.renderer.tokenizer.unk_token_id in segment["token_ids"]


@pytest.mark.parametrize("mode", ["detect", "off"])
def test_detect_counts_and_off_does_nothing(tiny_model_path: Path, tmp_path: Path, mode: str) -> None:
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(str(tiny_model_path)), "tiny")
    engine.replies.append(f"Yes, {EMAIL}.")
    gw = start_gateway(engine, tiny_model_path, f"sqlite:///{tmp_path / 'd.db'}", gateway={"redaction": mode})
    try:
        _post(gw, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": EMAIL}]}, "d")
        record = _session(gw, "d")
        assert record["redactions"] == ({"EMAIL": 2} if mode == "detect" else None)
        assert EMAIL in record["calls"][0]["response_message"]["content"]
        (segment,) = _segments(gw, "d")
        assert segment["token_ids"] == engine.prompts[0] + engine.samples[0] and all(
            segment["loss_mask"][len(engine.prompts[0]):])
    finally:
        gw.stop()


def test_a_key_may_have_its_own_redaction_mode(tiny_model_path: Path, tmp_path: Path) -> None:
    """The gateway redacts; one key keeps its users' data as sent, one only counts. The session's owner
    decides, so the admin's call in a session of the first key is kept as sent too."""
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(str(tiny_model_path)), "tiny")
    keys = {"plain": "key-plain", "kept": "key-kept", "counted": "key-counted"}
    gw = start_gateway(engine, tiny_model_path, f"sqlite:///{tmp_path / 'k.db'}", gateway={
        "admin_key": "key-admin", "api_keys": [keys["plain"], {"key": keys["kept"], "redaction": "off"},
                                               {"key": keys["counted"], "redaction": "detect"}]})
    admin = {"Authorization": "Bearer key-admin"}
    try:
        for name, key in [*keys.items(), ("kept", "key-admin")]:
            engine.replies.append(f"Yes, {EMAIL}.")
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"mail {EMAIL}"}]}
            response = httpx.post(f"{gw.url}/s/{name}/v1/chat/completions", json=body, timeout=60,
                                  headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"] == f"Yes, {EMAIL}."  # served as sampled
        stored = {name: httpx.get(f"{gw.url}/v1/sessions/{name}", headers=admin).json() for name in keys}
        assert stored["plain"]["redactions"] == {"EMAIL": 2}
        assert EMAIL not in json.dumps(stored["plain"]["calls"])
        assert stored["counted"]["redactions"] == {"EMAIL": 2}
        assert EMAIL in stored["counted"]["calls"][0]["response_message"]["content"]
        assert stored["kept"]["redactions"] is None
        assert all(EMAIL in call["response_message"]["content"] for call in stored["kept"]["calls"])
    finally:
        gw.stop()


def test_a_bad_redaction_mode_on_a_key_is_refused_when_the_config_loads() -> None:
    from pydantic import ValidationError

    from tracetrain.config import Config

    with pytest.raises(ValidationError, match="redaction"):
        Config(gateway={"api_keys": [{"key": "k", "redaction": "mask"}]})
