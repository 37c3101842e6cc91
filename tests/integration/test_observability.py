"""/health and Prometheus /metrics over real HTTP: the counters move with the traffic."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.engines.transformers_engine import TransformersEngine

MODEL = "tiny"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture
def gw(tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    """A gateway of its own per test (fresh counters); the wrapper keeps the module's engine open."""
    running = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path / 'gw.db'}")
    yield running
    running.stop()


class Metrics:
    """One scrape of /metrics: sample name + labels -> value."""

    def __init__(self, gw: RunningGateway) -> None:
        response = httpx.get(f"{gw.url}/metrics", timeout=30)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        families = list(text_string_to_metric_families(response.text))
        self.types = {family.name: family.type for family in families}
        self.samples = {
            (s.name, frozenset(s.labels.items())): s.value for family in families for s in family.samples
        }

    def __call__(self, name: str, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), 0.0)


def test_health(gw: RunningGateway) -> None:
    response = httpx.get(f"{gw.url}/health", timeout=30)
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["policy_version"] == 0
    assert body["store_queue_depth"] == 0


def test_metrics_move_with_calls_sessions_and_rewards(gw: RunningGateway) -> None:
    before = Metrics(gw)
    assert (
        before.types.items()
        >= {
            "tracetrain_requests": "counter",
            "tracetrain_tokens": "counter",
            "tracetrain_sessions_created": "counter",
            "tracetrain_rewards": "counter",
            "tracetrain_store_queue_depth": "gauge",
            "tracetrain_request_seconds": "histogram",
            "tracetrain_policy_version": "gauge",
        }.items()
    )
    assert before("tracetrain_requests_total", status="200", stream="false") == 0
    assert before("tracetrain_store_queue_depth") == 0
    assert before("tracetrain_policy_version") == 0

    client = OpenAI(base_url=gw.v1("obs-1"), api_key="unused", max_retries=0)
    first = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
    again = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    chunks = list(
        OpenAI(base_url=gw.v1("obs-2"), api_key="unused").chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    refused = httpx.post(f"{gw.v1('obs-1')}/chat/completions", json={"model": "gpt-9", "messages": HELLO})
    assert refused.status_code == 404
    reward = {"session_id": "obs-1", "reward": 1.0, "idempotency_key": "once"}
    for _ in range(2):  # the replay stores nothing and counts nothing
        httpx.post(f"{gw.url}/v1/rewards", json=reward, timeout=30).raise_for_status()

    after = Metrics(gw)
    assert first.usage and again.usage and chunks[-1].usage
    usages = (first.usage, again.usage, chunks[-1].usage)
    assert after("tracetrain_requests_total", status="200", stream="false") == 2
    assert after("tracetrain_requests_total", status="200", stream="true") == 1
    assert after("tracetrain_requests_total", status="404", stream="false") == 1
    assert after("tracetrain_tokens_total", kind="prompt") == sum(u.prompt_tokens for u in usages)
    assert (
        after("tracetrain_tokens_total", kind="completion") == sum(u.completion_tokens for u in usages) == 7
    )
    assert after("tracetrain_sessions_created_total") == 2, (
        "obs-1 and obs-2; the second call in obs-1 is no new one"
    )
    assert after("tracetrain_rewards_total") == 1
    assert after("tracetrain_store_queue_depth") == 0
    assert after("tracetrain_request_seconds_count", stream="false") == 2
    assert after("tracetrain_request_seconds_sum", stream="false") > 0
    assert after("tracetrain_request_seconds_bucket", stream="false", le="+Inf") == 2
    buckets = sorted(
        (float(dict(labels)["le"]), value)
        for (name, labels), value in after.samples.items()
        if name == "tracetrain_request_seconds_bucket" and dict(labels)["stream"] == "false"
    )
    assert len(buckets) > 5 and [v for _, v in buckets] == sorted(v for _, v in buckets), "cumulative buckets"


def test_streamed_requests_are_timed(gw: RunningGateway) -> None:
    client = OpenAI(base_url=gw.v1("obs-stream"), api_key="unused", max_retries=0)
    list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, stream=True))
    assert Metrics(gw)("tracetrain_request_seconds_count", stream="true") == 1
