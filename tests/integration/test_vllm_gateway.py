"""The gateway in front of a real vLLM server (CPU): exact tokens, streaming, multi-turn chains."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway

pytestmark = pytest.mark.vllm


def _segments(gw: RunningGateway, session: str) -> list[dict[str, Any]]:
    (trajectory,) = httpx.get(f"{gw.url}/v1/sessions/{session}/trajectory").json()["trajectories"]
    return trajectory["segments"]  # type: ignore[no-any-return]


def test_multi_turn_chat_through_vllm_is_token_exact(vllm_gateway: RunningGateway) -> None:
    client = OpenAI(base_url=vllm_gateway.v1("v-chat"), api_key="unused")
    model = vllm_gateway.gateway.config.served_model_name
    messages: list[Any] = [{"role": "user", "content": "Name a colour."}]
    for follow_up in ("Another one?", "And a third?"):
        reply = client.chat.completions.create(model=model, messages=messages, temperature=0.7, seed=1,
                                               max_tokens=12)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": follow_up}]
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0.7, seed=1,
                                            max_tokens=12, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    engine = vllm_gateway.gateway.engine
    assert isinstance(engine, RecordingEngine)
    generations = engine.generations[-3:]
    (segment,) = _segments(vllm_gateway, "v-chat")
    assert segment["reason"] == "start" and len(segment["call_ids"]) == 3
    assert segment["token_ids"] == generations[-1].prompt_ids + generations[-1].token_ids
    assert sum(segment["loss_mask"]) == sum(len(g.token_ids) for g in generations)
    sampled_logprobs = [lp for lp, m in zip(segment["logprobs"], segment["loss_mask"], strict=True) if m]
    assert sampled_logprobs == pytest.approx([lp for g in generations for lp in g.logprobs], abs=1e-6)
    tokenizer = vllm_gateway.gateway.renderer.tokenizer
    assert streamed == tokenizer.decode(generations[-1].token_ids, skip_special_tokens=True)


def test_engine_errors_from_vllm_are_openai_errors(vllm_gateway: RunningGateway, vllm_server: Any) -> None:
    long_prompt = "word " * (vllm_server.max_model_len + 100)
    response = httpx.post(f"{vllm_gateway.v1('v-long')}/chat/completions", timeout=120, json={
        "model": vllm_gateway.gateway.config.served_model_name, "max_tokens": 4,
        "messages": [{"role": "user", "content": long_prompt}]})
    assert response.status_code == 400
    assert "maximum context length" in response.json()["error"]["message"]
