"""Canary promotion for a named policy (docs/architecture.md, decisions 11 and 13): each policy's new version is
a canary of its own line, tested on that policy's sessions only, through a real gateway in front of the
in-process tool model.

The reward is the agent's own check of the answer (did it call `add`?). A LoRA adapter with large random
weights (it writes garbage) staged for policy `support` must be rolled back by the sequential test, seen by no
more than its share of `support`'s sessions, while the default line's sessions keep the base model and are
neither counted nor set aside. A sound adapter (peft's identity start) is promoted by an admin with
`?policy=support`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session, select

from tests.support.servers import RunningGateway, start_gateway
from tests.support.tool_model import ADD_TOOL, QUESTION
from tracetrain.engines.transformers_publish import InProcessPublisher
from tracetrain.proxy.promotion import assigned_to_canary
from tracetrain.store.db import open_db
from tracetrain.store.models import AgentSession

pytestmark = pytest.mark.slow

SHARE = 0.4


@pytest.fixture
def gateway(tool_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    from tracetrain.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(tool_model_path, model_name="tool-tiny")
    running = start_gateway(engine, tool_model_path, f"sqlite:///{tmp_path / 'canary.db'}",
                            publisher=InProcessPublisher(engine),
                            promotion={"mode": "canary", "canary_share": SHARE, "min_sessions": 6, "margin": 0.1})
    assert httpx.post(f"{running.url}/v1/policies", json={"name": "support"}).status_code == 200
    yield running
    running.stop()


def _adapter(tool_model_path: Path, target: Path, scale: float) -> Path:
    """A PEFT LoRA adapter for the tool model: B drawn at `scale` (0: peft's start, the base model unchanged)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tracetrain.trainer.checkpoint import LORA_TARGETS

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(tool_model_path), dtype=torch.float32)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, scale) if scale else param.zero_()
    model.save_pretrained(str(target))
    return target


def _episode(gateway: RunningGateway, session: str, policy: str | None) -> tuple[int, float]:
    """One agent session of `policy` (bound by path; None: the default line): (version served, reward)."""
    prefix = f"/p/{policy}" if policy else ""
    response = httpx.post(f"{gateway.url}{prefix}/s/{session}/v1/chat/completions", timeout=60, json={
        "model": "tool-tiny", "messages": [{"role": "user", "content": QUESTION}], "tools": [ADD_TOOL],
        "temperature": 0, "max_tokens": 40})
    assert response.status_code == 200, response.text
    calls = response.json()["choices"][0]["message"].get("tool_calls") or []
    reward = 1.0 if calls and calls[0]["function"]["name"] == "add" else 0.0
    posted = httpx.post(f"{gateway.url}/v1/rewards", json={"session_id": session, "reward": reward, "final": True})
    assert posted.status_code == 200, posted.text
    return int(response.headers["X-Policy-Version"]), reward


def _row(gateway: RunningGateway, line: str, version: int) -> dict[str, Any]:
    listing = httpx.get(f"{gateway.url}/v1/policies", params={"policy": line}).json()
    return next(p for p in listing["data"] if p["version"] == version)


def _publish(gateway: RunningGateway, version: int, path: Path, policy: str) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/policies", timeout=120,
                      json={"version": version, "checkpoint": str(path), "kind": "lora", "policy": policy})


def test_a_broken_version_of_a_named_policy_is_rolled_back_on_its_own_sessions(
        gateway: RunningGateway, tool_model_path: Path, tmp_path: Path) -> None:
    assert _publish(gateway, 1, _adapter(tool_model_path, tmp_path / "broken", 2.0), "support").status_code == 200
    listing = httpx.get(f"{gateway.url}/v1/policies").json()
    assert listing["promotion"]["canary"] is None, "the default line has no canary"
    assert listing["promotion"]["canaries"]["support"]["version"] == 1
    assert listing["served_versions"]["support"] == 0, "the incumbent, the base model, serves the rest"
    refused = _publish(gateway, 2, tmp_path / "broken", "support")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "canary_on_trial"

    served: dict[str, tuple[int, float]] = {}
    default: list[tuple[int, float]] = []
    for i in range(120):
        session = f"s-{i}"
        served[session] = _episode(gateway, session, "support")
        default.append(_episode(gateway, f"d-{i}", None))
        if _row(gateway, "support", 1)["promotion"] != "canary":
            break
    row = _row(gateway, "support", 1)
    assert row["promotion"] == "rolled_back", row
    decision = row["decision"]
    print(f"\nbroken canary of support: {len(served)} sessions, decision {decision}")
    assert decision["by"] == "test" and decision["canary_n"] >= 6 and decision["incumbent_n"] >= 6
    # Only support's sessions count: as many as it ran, the default line's are in neither arm.
    assert decision["canary_n"] + decision["incumbent_n"] <= len(served)
    assert decision["canary_mean"] < decision["incumbent_mean"]
    # The sessions whose hash falls in the share saw the canary (the last one may have been served as the
    # rollback landed), and it failed them; the default line never saw it.
    last = list(served)[-1]
    for session, (version, reward) in served.items():
        if session != last:
            assert version == (1 if assigned_to_canary(session, SHARE) else 0), session
        assert reward == (0.0 if version == 1 else 1.0)
    assert all(v == 0 and r == 1.0 for v, r in default)
    # After the rollback no session of support gets it again, and its sessions are set aside.
    assert httpx.get(f"{gateway.url}/v1/policies").json()["promotion"]["canaries"] == {}
    assert all(_episode(gateway, f"after-{i}", "support")[0] == 0 for i in range(5))
    with Session(open_db(gateway.gateway.config.store.url)) as db:
        rows = db.exec(select(AgentSession.policy, AgentSession.policy_version, AgentSession.skip_reason)).all()
    assert {reason for policy, v, reason in rows if v == 1} == {"rolled_back"}
    assert all(policy == "support" for policy, v, _ in rows if v == 1)
    assert all(reason is None for policy, v, reason in rows if v == 0)


def test_an_admin_promotes_a_named_policys_canary_by_hand(gateway: RunningGateway, tool_model_path: Path,
                                                          tmp_path: Path) -> None:
    assert _publish(gateway, 1, _adapter(tool_model_path, tmp_path / "same", 0.0), "support").status_code == 200
    # The default line has no canary; an unknown policy is no line at all.
    wrong_line = httpx.post(f"{gateway.url}/v1/policies/1/promote")
    assert wrong_line.status_code == 409 and wrong_line.json()["error"]["code"] == "not_a_canary"
    unknown = httpx.post(f"{gateway.url}/v1/policies/1/promote", params={"policy": "nobody"})
    assert unknown.status_code == 404, unknown.text
    promoted = httpx.post(f"{gateway.url}/v1/policies/1/promote", params={"policy": "support"},
                          json={"note": "looks fine"})
    assert promoted.status_code == 200, promoted.text
    assert promoted.json() == {"version": 1, "promotion": "promoted", "served_version": 1}
    row = _row(gateway, "support", 1)
    assert row["promotion"] == "promoted" and row["decision"]["by"] == "admin"
    assert {_episode(gateway, f"s-{i}", "support")[0] for i in range(6)} == {1}
    assert {_episode(gateway, f"d-{i}", None)[0] for i in range(3)} == {0}
    again = httpx.post(f"{gateway.url}/v1/policies/1/rollback", params={"policy": "support"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "not_a_canary"
