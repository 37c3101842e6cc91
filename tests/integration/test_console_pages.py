"""What the console's pages read, over real HTTP: who the caller is, the overview (traffic counters,
sessions by status, the trainer's state, the last publish), token texts on a trajectory; and the pages
themselves, served by the gateway from package files that fetch nothing from elsewhere."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from sqlmodel import Session

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.engines.transformers_engine import TransformersEngine
from tracetrain.proxy.auth import fingerprint
from tracetrain.proxy.console_ui import CONSOLE_DIR
from tracetrain.store import leases
from tracetrain.store.models import Policy, utcnow

MODEL = "tiny"
ADMIN = {"Authorization": "Bearer admin"}
AGENT = {"Authorization": "Bearer agent-a"}


@pytest.fixture
def keyed(tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    running = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path / 'pages.db'}",
                            gateway={"api_keys": ["agent-a"], "admin_key": "admin"})
    yield running
    running.stop()


def _get(gw: RunningGateway, path: str, headers: dict[str, str] | None = None, **params: Any) -> httpx.Response:
    return httpx.get(gw.url + path, headers=headers, params=params, timeout=30)


def _chat(gw: RunningGateway, session: str, *turns: str) -> None:
    client = OpenAI(base_url=gw.v1(session), api_key="agent-a", max_retries=0)
    history: list[Any] = []
    for text in turns:
        history.append({"role": "user", "content": text})
        reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4)
        history.append({"role": "assistant", "content": reply.choices[0].message.content or ""})


def test_whoami_names_the_key_and_whether_it_is_the_admin(keyed: RunningGateway, gateway: RunningGateway) -> None:
    assert _get(keyed, "/v1/whoami", ADMIN).json() == {"owner": fingerprint("admin"), "admin": True,
                                                       "keys_required": True, "policy": None}
    assert _get(keyed, "/v1/whoami", AGENT).json() == {"owner": fingerprint("agent-a"), "admin": False,
                                                       "keys_required": True, "policy": None}
    assert _get(keyed, "/v1/whoami").status_code == 401
    assert _get(keyed, "/v1/whoami", {"Authorization": "Bearer nope"}).status_code == 401
    assert _get(gateway, "/v1/whoami").json() == {"owner": None, "admin": True, "keys_required": False,
                                                "policy": None}


def test_the_overview_counts_traffic_sessions_the_trainer_and_the_last_publish(keyed: RunningGateway) -> None:
    assert _get(keyed, "/v1/overview", AGENT).status_code == 403
    empty = _get(keyed, "/v1/overview", ADMIN).json()
    assert empty["counters"] == {"requests": 0, "failed_requests": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                 "sessions_created": 0, "rewards": 0}
    assert empty["sessions"] == {"open": 0, "final": 0} and empty["served_version"] == 0
    assert empty["trainer"]["state"] == "waiting" and empty["last_publish"] is None

    _chat(keyed, "ov-1", "hello", "again")
    _chat(keyed, "ov-2", "hi")
    posted = httpx.post(f"{keyed.url}/v1/rewards", json={"session_id": "ov-1", "reward": 1, "final": True},
                        headers=AGENT, timeout=30)
    assert posted.status_code == 200
    bad = httpx.post(f"{keyed.v1('ov-3')}/chat/completions", headers=AGENT, timeout=30,
                     json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert bad.status_code == 404
    seen = _get(keyed, "/v1/overview", ADMIN).json()
    counters = seen["counters"]
    assert (counters["requests"], counters["failed_requests"], counters["sessions_created"], counters["rewards"]) \
        == (4, 1, 2, 1), "three calls answered, one refused (unknown model)"
    stored = [c for s in ("ov-1", "ov-2") for c in _get(keyed, f"/v1/sessions/{s}", ADMIN).json()["calls"]]
    assert counters["completion_tokens"] == sum(c["completion_tokens"] for c in stored)
    assert counters["prompt_tokens"] == sum(c["prompt_tokens"] for c in stored)
    assert seen["sessions"] == {"open": 1, "final": 1}
    assert seen["trainer"] | {"last_step_at": None} == {"state": "waiting", "ready": 1, "leased": 0, "holders": [],
                                                         "last_step_at": None}
    assert seen["time"] > empty["time"]

    # a trainer's claim, then a hold on generation (a sync-mode step), then a recorded, published version
    with Session(keyed.gateway.db) as db:
        assert leases.claim_sessions(db, trainer_id="t-1", limit=10, lease_s=60) == ["ov-1"]
        db.commit()
    assert _get(keyed, "/v1/overview", ADMIN).json()["trainer"]["state"] == "stepping"
    held = httpx.post(f"{keyed.url}/v1/generation/hold", json={"holder": "t-1", "ttl_s": 30}, headers=ADMIN,
                      timeout=30)
    assert held.status_code == 200, held.text
    trainer = _get(keyed, "/v1/overview", ADMIN).json()["trainer"]
    assert (trainer["state"], trainer["holders"], trainer["leased"]) == ("held", ["remote:t-1"], 1)
    httpx.post(f"{keyed.url}/v1/generation/release", json={"holder": "t-1"}, headers=ADMIN, timeout=30)
    with Session(keyed.gateway.db) as db:
        db.add(Policy(version=1, checkpoint="/nowhere", kind="full", published_at=utcnow(),
                      metrics={"reward_mean": 1.0, "publish_seconds": 0.25}))
        db.commit()
    last = _get(keyed, "/v1/overview", ADMIN).json()
    assert last["last_publish"] | {"published_at": None} == {"version": 1, "published_at": None, "seconds": 0.25,
                                                            "error": None}
    assert last["last_publish"]["published_at"] and last["trainer"]["last_step_at"]


def test_a_trajectory_carries_each_tokens_text_on_request(keyed: RunningGateway) -> None:
    _chat(keyed, "tx-1", "What is 2 + 3?", "And 4 + 4?")
    plain = _get(keyed, "/v1/sessions/tx-1/trajectory", AGENT).json()
    with_text = _get(keyed, "/v1/sessions/tx-1/trajectory", AGENT, text="true").json()
    tokenizer = keyed.gateway.renderer.tokenizer
    for trajectory, plain_one in zip(with_text["trajectories"], plain["trajectories"], strict=True):
        for segment, plain_segment in zip(trajectory["segments"], plain_one["segments"], strict=True):
            assert "token_texts" not in plain_segment
            assert {k: v for k, v in segment.items() if k != "token_texts"} == plain_segment
            assert segment["token_texts"] == [tokenizer.decode([t]) for t in segment["token_ids"]]
            assert "".join(segment["token_texts"]).startswith("<|im_start|>")
            assert "What is 2 + 3?" in "".join(segment["token_texts"])


def test_the_console_is_served_from_the_package_and_fetches_nothing_elsewhere(keyed: RunningGateway) -> None:
    redirect = _get(keyed, "/ui")
    assert redirect.status_code in (307, 308) and redirect.headers["location"].endswith("/ui/")
    page = _get(keyed, "/ui/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "tracetrain console" in page.text
    referenced = re.findall(r'(?:src|href)="([^"#]+)"', page.text)
    assert set(referenced) == {"vendor/uPlot.min.css", "console.css", "vendor/uPlot.iife.min.js", "console.js"}
    for name in referenced:
        assert _get(keyed, f"/ui/{name}").status_code == 200, name
    files = [p for p in CONSOLE_DIR.rglob("*") if p.is_file()]
    assert {"uPlot.LICENSE", "VERSION"} <= {p.name for p in files}
    for path in files:
        if path.suffix in {".html", ".js", ".css"} and path.parent == CONSOLE_DIR:
            assert not re.search(r"https?://", path.read_text()), f"{path.name} refers to another host"
    assert _get(keyed, "/ui/missing.js").status_code == 404


def test_the_console_endpoints_are_documented(gateway: RunningGateway) -> None:
    document = _get(gateway, "/openapi.json").json()
    paths = document["paths"]

    def ok_schema(path: str) -> str:
        return str(paths[path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
                   .rsplit("/", 1)[-1])

    assert ok_schema("/v1/whoami") == "WhoAmI" and ok_schema("/v1/overview") == "Overview"
    assert {"401", "403"} <= paths["/v1/overview"]["get"]["responses"].keys()
    parameters = {p["name"] for p in paths["/v1/sessions/{session_id}/trajectory"]["get"]["parameters"]}
    assert "text" in parameters
    assert not [path for path in paths if path.startswith("/ui")], "the pages are not part of the API"
