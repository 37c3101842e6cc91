"""The gateway in front of a real vLLM server (CPU): exact tokens, streaming, multi-turn chains."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway
from tracetrain.engines.vllm_server import http_client

pytestmark = pytest.mark.vllm


def _segments(gw: RunningGateway, session: str) -> list[dict[str, Any]]:
    (trajectory,) = httpx.get(f"{gw.url}/v1/sessions/{session}/trajectory").json()["trajectories"]
    return trajectory["segments"]  # type: ignore[no-any-return]


def test_multi_turn_chat_through_vllm_is_token_exact(vllm_gateway: RunningGateway) -> None:
    client = OpenAI(base_url=vllm_gateway.v1("v-chat"), api_key="unused")
    model = vllm_gateway.gateway.config.engine.served_model_name
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
        "model": vllm_gateway.gateway.config.engine.served_model_name, "max_tokens": 4,
        "messages": [{"role": "user", "content": long_prompt}]})
    assert response.status_code == 400
    assert "maximum context length" in response.json()["error"]["message"]


def _metric(vllm_server: Any, name: str) -> float:
    """One of vLLM's Prometheus counters or gauges (labels included in `name`)."""
    with http_client(vllm_server.url, timeout=10) as client:
        for line in client.get("/metrics").text.splitlines():
            if line.startswith(name):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


GENERATED = "vllm:generation_tokens_total"


def test_a_client_that_leaves_a_stream_stops_its_generation(vllm_gateway: RunningGateway, vllm_server: Any) -> None:
    """Closing the connection mid-stream aborts the request in vLLM at once (it generates nothing more;
    left running, this one goes on for hundreds of tokens, several seconds here), and nothing is recorded
    for the unfinished call."""
    counting = ", ".join(str(i) for i in range(1, 40)) + ","  # the model goes on counting
    body = {"model": vllm_gateway.gateway.config.engine.served_model_name, "max_tokens": 3000, "stream": True,
            "temperature": 0.0, "prompt": counting}
    with httpx.Client(timeout=120) as client, \
            client.stream("POST", f"{vllm_gateway.v1('v-leaves')}/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if '"text":"' in line and '"text":""' not in line:
                break  # the first text: the generation is running
        generated = _metric(vllm_server, GENERATED)
    time.sleep(3)
    assert _metric(vllm_server, GENERATED) - generated < 32, "vLLM went on generating for a client that left"
    assert httpx.get(f"{vllm_gateway.url}/v1/sessions/v-leaves").status_code == 404
