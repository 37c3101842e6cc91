"""Named policies over real HTTP: how a call is bound to one (its key, a `/p/{policy}` path, its `model`), what
creating one checks, and isolation: a key bound to one policy reaches no other policy's sessions or traffic,
on every route (the matrix below), and a refused request records nothing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from sqlmodel import Session

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.engines.base import Affinity, SamplingParams, TokenDelta
from tracetrain.engines.transformers_engine import TransformersEngine
from tracetrain.store import queries
from tracetrain.store.export import export
from tracetrain.store.models import Policy, utcnow

MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": HI, "max_tokens": 2}
KEYS = {"admin": "admin", "owner": "sk-coding", "same_policy": "sk-coding-2", "other_policy": "sk-support",
        "unbound": "plain"}
"""Who asks, about sessions of policy `coding` created by `owner`: the admin key; the key that created them; another
key bound to `coding`; a key bound to `support` (policy A asking about policy B); a key bound to no policy."""
WHO = tuple(KEYS)


@pytest.fixture(scope="module")
def gw(tiny_engine: TransformersEngine, tiny_model_path: Path,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    running = start_gateway(
        RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path_factory.mktemp('policies') / 'gw.db'}",
        engine={"max_loras": 4},  # the default policy, two declared, room for one created over the API
        gateway={"admin_key": "admin",
                 "policies": [{"name": "support", "settings": {"lr": 1e-5}}, {"name": "coding"}],
                 "api_keys": ["plain", {"key": "sk-support", "policy": "support"},
                              {"key": "sk-coding", "policy": "coding"}, {"key": "sk-coding-2", "policy": "coding"}]})
    yield running
    running.stop()


def _send(gw: RunningGateway, who: str, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request(method, gw.url + path, json=body, headers={"Authorization": f"Bearer {KEYS[who]}"},
                         timeout=60)


def _refused(response: httpx.Response, status: int, code: str) -> None:
    """`status` in the API's own error shape: Anthropic's on the Messages API's paths (no code there), OpenAI's
    elsewhere."""
    assert response.status_code == status, response.text
    body = response.json()
    if "/v1/messages" in str(response.request.url):
        anthropic = {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error"}
        assert body["type"] == "error" and body["error"]["type"] == anthropic[status]
    else:
        assert body["error"]["code"] == code, body


def _session(gw: RunningGateway, session_id: str) -> dict[str, Any]:
    found = _send(gw, "admin", "GET", f"/v1/sessions/{session_id}")
    assert found.status_code == 200, found.text
    return found.json()  # type: ignore[no-any-return]


def _footprint(gw: RunningGateway, session_id: str) -> tuple[int, int, str, bool]:
    """What a refused request must leave as it was: the session's calls, rewards, status and exclusion."""
    s = _session(gw, session_id)
    return len(s["calls"]), len(s["rewards"]), s["status"], s["excluded"]


# --- binding ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("who", "path", "model", "policy"), [
    ("unbound", "/s/bind-none/v1", MODEL, "default"),
    ("other_policy", "/s/bind-key/v1", MODEL, "support"),
    ("unbound", "/p/coding/s/bind-path/v1", MODEL, "coding"),
    ("unbound", "/s/bind-model/v1", "coding", "coding"),
    ("admin", "/p/support/s/bind-admin-path/g/g1/v1", "support", "support"),
    ("owner", "/p/coding/s/bind-key-and-path/v1", "coding", "coding"),
])
def test_a_call_is_bound_by_key_path_or_model_and_its_session_records_it(gw: RunningGateway, who: str, path: str,
                                                                         model: str, policy: str) -> None:
    reply = _send(gw, who, "POST", f"{path}/chat/completions", {**CHAT, "model": model})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == model
    assert _session(gw, reply.headers["x-session-id"])["policy"] == policy


@pytest.mark.parametrize(("who", "path", "model", "status", "code"), [
    ("unbound", "/p/nowhere/v1", MODEL, 404, "policy_not_found"),
    ("unbound", "/p/Not%20A%20Name/v1", MODEL, 400, "invalid_policy"),
    ("unbound", "/v1", "nowhere", 404, "model_not_found"),
    ("other_policy", "/p/coding/v1", MODEL, 403, "policy_forbidden"),  # the key says support, the path coding
    ("other_policy", "/v1", "coding", 403, "policy_forbidden"),  # the key says support, the model coding
    ("unbound", "/p/support/v1", "coding", 403, "policy_forbidden"),  # the path says support, the model coding
    ("admin", "/p/support/v1", "coding", 403, "policy_forbidden"),
])
def test_an_unknown_or_conflicting_policy_is_refused_and_records_nothing(gw: RunningGateway, who: str, path: str,
                                                                         model: str, status: int, code: str) -> None:
    before = _send(gw, "admin", "GET", "/v1/sessions?limit=1").json()["total"]
    _refused(_send(gw, who, "POST", f"{path}/chat/completions", {**CHAT, "model": model}), status, code)
    _refused(_send(gw, who, "POST", f"{path}/messages", {"model": model, "max_tokens": 2, "messages": HI}),
             status, code)
    assert _send(gw, "admin", "GET", "/v1/sessions?limit=1").json()["total"] == before


def test_a_session_never_changes_policy(gw: RunningGateway) -> None:
    """A session is in the policy of its first call; later calls naming another policy (by path or model) are 403
    and record nothing; a call naming none, or the same one, continues it."""
    assert _send(gw, "unbound", "POST", "/s/fixed/v1/chat/completions", CHAT).status_code == 200
    before = _footprint(gw, "fixed")
    _refused(_send(gw, "unbound", "POST", "/p/coding/s/fixed/v1/chat/completions", CHAT), 403, "policy_forbidden")
    _refused(_send(gw, "unbound", "POST", "/s/fixed/v1/chat/completions", {**CHAT, "model": "coding"}), 403,
             "policy_forbidden")
    _refused(_send(gw, "admin", "POST", "/p/coding/s/fixed/v1/rewards", {"reward": 1.0}), 403, "policy_forbidden")
    assert _footprint(gw, "fixed") == before
    assert _send(gw, "unbound", "POST", "/p/default/s/fixed/v1/chat/completions", CHAT).status_code == 200
    assert _session(gw, "fixed")["policy"] == "default" and _footprint(gw, "fixed")[0] == before[0] + 1


# --- the isolation matrix -----------------------------------------------------------------------------

SF, PF, AR = (403, "session_forbidden"), (403, "policy_forbidden"), (403, "admin_required")
OK = (200, "")
OWNED = {"admin": OK, "owner": OK, "same_policy": SF, "other_policy": PF, "unbound": SF}
"""A route on one session: its owner and the admin only; a key bound to another policy is refused for the policy."""
ADMIN_ONLY = {"admin": OK, "owner": AR, "same_policy": AR, "other_policy": AR, "unbound": AR}
POLICY_TRAFFIC = {"admin": OK, "owner": OK, "same_policy": OK, "other_policy": PF, "unbound": OK}
"""Traffic to (or a listing of) the policy as a whole: any key but one bound to another policy."""

MATRIX: list[tuple[str, str, dict[str, Any] | None, dict[str, tuple[int, str]]]] = [
    ("GET", "/v1/sessions/{sid}", None, OWNED),
    ("GET", "/v1/sessions/{sid}/trajectory", None, OWNED),
    ("GET", "/v1/responses/{rid}", None, OWNED),
    ("GET", "/s/{sid}/v1/responses/{rid}", None, OWNED),
    ("POST", "/v1/rewards", {"session_id": "{sid}", "reward": 0.5}, OWNED),
    ("POST", "/v1/rewards", {"completion_id": "{cid}", "reward": 0.5}, OWNED),
    ("POST", "/s/{sid}/v1/rewards", {"reward": 0.5}, OWNED),
    ("POST", "/s/{sid}/g/g/v1/rewards", {"reward": 0.5}, OWNED),
    ("POST", "/p/coding/s/{sid}/v1/rewards", {"reward": 0.5}, OWNED),
    ("POST", "/s/{sid}/v1/chat/completions", CHAT, OWNED),
    ("POST", "/p/coding/s/{sid}/v1/chat/completions", CHAT, OWNED),
    ("POST", "/s/{sid}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, OWNED),
    ("POST", "/s/{sid}/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2}, OWNED),
    ("POST", "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2,
                               "previous_response_id": "{rid}"}, OWNED),
    ("POST", "/s/{sid}/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": HI}, OWNED),
    ("POST", "/s/{sid}/v1/messages/count_tokens", {"model": MODEL, "messages": HI}, OWNED),
    ("POST", "/v1/sessions/{sid}/exclude", {"note": "matrix"}, ADMIN_ONLY),
    ("POST", "/v1/sessions/{sid}/include", None, ADMIN_ONLY),
    ("POST", "/v1/sessions/{sid}/reward_override", {"reward": 0.0, "note": "matrix"}, ADMIN_ONLY),
    ("DELETE", "/v1/sessions/{sid}/reward_override", None, ADMIN_ONLY),
    ("GET", "/v1/sessions/{sid}/actions", None, ADMIN_ONLY),
    ("GET", "/v1/export", None, ADMIN_ONLY),
    ("GET", "/v1/export?policy=coding", None, ADMIN_ONLY),
    ("GET", "/v1/policies?policy=coding", None, ADMIN_ONLY),
    ("POST", "/p/coding/v1/chat/completions", CHAT, POLICY_TRAFFIC),
    ("POST", "/v1/chat/completions", {**CHAT, "model": "coding"}, POLICY_TRAFFIC),
    ("POST", "/p/coding/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": HI}, POLICY_TRAFFIC),
    ("GET", "/p/coding/v1/models", None, POLICY_TRAFFIC),
    ("GET", "/v1/sessions?policy=coding", None, POLICY_TRAFFIC),
    # Deciding a policy's canary is the admin's (it has none on trial here).
    ("POST", "/v1/policies/1/promote?policy=coding", None, {**ADMIN_ONLY, "admin": (409, "not_a_canary")}),
    ("POST", "/v1/policies/1/rollback?policy=coding", None, {**ADMIN_ONLY, "admin": (409, "not_a_canary")}),
    ("DELETE", "/v1/sessions/{sid}", None, ADMIN_ONLY),  # last: it clears the session's content
]


def _fill(value: Any, ids: dict[str, str]) -> Any:
    if isinstance(value, str):
        return value.format(**ids)
    if isinstance(value, dict):
        return {k: _fill(v, ids) for k, v in value.items()}
    return value


def test_isolation_matrix_every_route_by_every_key(gw: RunningGateway) -> None:
    """Each route, asked by each key about a session of policy `coding`: the status (and code) of the matrix; a
    refused request leaves the session as it was."""
    created = _send(gw, "owner", "POST", "/s/iso/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2})
    assert created.status_code == 200, created.text
    ids = {"sid": "iso", "rid": created.json()["id"],
           "cid": _session(gw, "iso")["calls"][0]["completion_id"]}
    assert _session(gw, "iso")["policy"] == "coding"
    seen: list[tuple[str, str, int]] = []
    for method, path, body, expected in MATRIX:
        for who in WHO:
            status, code = expected[who]
            before = _footprint(gw, "iso")
            response = _send(gw, who, method, _fill(path, ids), _fill(body, ids))
            if status == 200:
                assert response.status_code == 200, (method, path, who, response.text)
            else:
                _refused(response, status, code)
                assert _footprint(gw, "iso") == before, (method, path, who)
            seen.append((f"{method} {path}", who, response.status_code))
    assert len(seen) == len(MATRIX) * len(WHO)


def test_listing_and_export_filter_by_policy(gw: RunningGateway, tmp_path: Path) -> None:
    for who, path in (("owner", "/s/list-coding/v1"), ("other_policy", "/s/list-support/v1"),
                      ("unbound", "/s/list-default/v1")):
        assert _send(gw, who, "POST", f"{path}/chat/completions", CHAT).status_code == 200
    assert _send(gw, "admin", "POST", "/v1/rewards", {"session_id": "list-coding", "reward": 1.0}).status_code == 200

    def listed(who: str, query: str = "") -> set[str]:
        found = _send(gw, who, "GET", f"/v1/sessions?limit=1000{query}")
        assert found.status_code == 200, found.text
        return {s["policy"] for s in found.json()["data"]}

    assert listed("other_policy") == {"support"}, "a key bound to a policy lists only that policy's sessions"
    assert listed("other_policy", "&policy=support") == {"support"}
    assert listed("admin", "&policy=coding") == {"coding"}
    assert listed("admin") >= {"coding", "support", "default"}
    _refused(_send(gw, "admin", "GET", "/v1/sessions?policy=nowhere"), 404, "policy_not_found")
    _refused(_send(gw, "admin", "GET", "/v1/sessions?policy=Bad%20Name"), 400, "invalid_value")

    exported = _send(gw, "admin", "GET", "/v1/export?policy=coding")
    assert exported.status_code == 200
    rows = [orjson.loads(line) for line in exported.content.splitlines()]
    assert "list-coding" in {r["session_id"] for r in rows}
    assert {_session(gw, r["session_id"])["policy"] for r in rows} == {"coding"}
    audit = _send(gw, "admin", "GET", "/v1/audit?action=export&limit=1").json()["data"][0]
    assert audit["detail"] == {"format": "jsonl", "policy": "coding"}
    _refused(_send(gw, "admin", "GET", "/v1/export?policy=nowhere"), 404, "policy_not_found")
    # `tracetrain export --policy support`, offline, from the same store.
    out = tmp_path / "support.jsonl"
    assert export(gw.gateway.db, out, "jsonl", policy="support") >= 1
    offline = {orjson.loads(line)["session_id"] for line in out.read_bytes().splitlines()}
    assert "list-support" in offline and {_session(gw, sid)["policy"] for sid in offline} == {"support"}


def test_the_overview_and_whoami_narrow_to_a_policy(gw: RunningGateway) -> None:
    for who, path in (("owner", "/s/ov-coding/v1"), ("owner", "/s/ov-coding-2/v1"),
                      ("other_policy", "/s/ov-support/v1"), ("unbound", "/s/ov-default/v1")):
        assert _send(gw, who, "POST", f"{path}/chat/completions", CHAT).status_code == 200
    assert _send(gw, "owner", "POST", "/v1/rewards", {"session_id": "ov-coding", "reward": 1.0,
                                                      "final": True}).status_code == 200
    with Session(gw.gateway.db) as db:  # a version of support's line only: the default line stays at v0
        db.add(Policy(line="support", version=1, checkpoint="/s1", kind="lora", published_at=utcnow(),
                      promotion="immediate", metrics={"reward_mean": 0.5}))
        db.commit()

    def overview(query: str = "") -> dict[str, Any]:
        found = _send(gw, "admin", "GET", f"/v1/overview{query}")
        assert found.status_code == 200, found.text
        return found.json()  # type: ignore[no-any-return]

    def statuses(query: str) -> dict[str, int]:
        listed = _send(gw, "admin", "GET", f"/v1/sessions?limit=1000{query}").json()["data"]
        return {status: sum(s["status"] == status for s in listed) for status in ("open", "final")}

    every, coding, support = overview(), overview("?policy=coding"), overview("?policy=support")
    assert every["policy"] is None and every["last_publish"] is None, "all policies: the default line's versions"
    assert {"default", "support", "coding"} <= every["served_versions"].keys()
    assert every["sessions"] == statuses("")
    assert coding["policy"] == "coding" and coding["served_versions"] == {"coding": 0}
    assert coding["sessions"] == statuses("&policy=coding") and coding["sessions"]["final"] >= 1
    assert coding["sessions"]["open"] + coding["sessions"]["final"] < every["sessions"]["open"] + every[
        "sessions"]["final"]
    assert coding["last_publish"] is None
    assert support["sessions"] == statuses("&policy=support")
    assert support["last_publish"] is not None and support["last_publish"]["version"] == 1, "support's own line"
    ready = _send(gw, "admin", "GET", "/v1/policies?policy=coding").json()["sessions"]["ready"]
    assert coding["trainer"]["ready"] == ready

    _refused(_send(gw, "admin", "GET", "/v1/overview?policy=nowhere"), 404, "policy_not_found")
    _refused(_send(gw, "admin", "GET", "/v1/overview?policy=Bad%20Name"), 400, "invalid_value")
    _refused(_send(gw, "other_policy", "GET", "/v1/overview?policy=support"), 403, "admin_required")
    _refused(_send(gw, "other_policy", "GET", "/v1/sessions?policy=coding"), 403, "policy_forbidden")
    whoami = {who: _send(gw, who, "GET", "/v1/whoami").json()["policy"] for who in ("admin", "other_policy", "unbound")}
    assert whoami == {"admin": None, "other_policy": "support", "unbound": None}


# --- creating policies ----------------------------------------------------------------------------------


def test_creating_a_policy_over_the_api(gw: RunningGateway) -> None:
    """Admin only; checked as the config is (LoRA only, its settings, engine.max_loras); usable at once."""
    # 16.0 is an integer in JSON Schema (fuzzers send such), taken as 16; 8.5 is not one.
    body = {"name": "data", "settings": {"lr": 5e-5, "advantage": "grpo", "retention_days": 30, "batch_sessions": 16.0}}
    _refused(_send(gw, "unbound", "POST", "/v1/policies", body), 403, "admin_required")
    _refused(_send(gw, "admin", "POST", "/v1/policies", {**body, "training": "full"}), 400, "full_weight_policy")
    refused = _send(gw, "admin", "POST", "/v1/policies", {**body, "training": "full"}).json()["error"]["message"]
    assert "full-weight training would change the base model under every other policy" in refused
    # The document types every setting a policy may set; one it may not, or a wrong type, is refused by it.
    _refused(_send(gw, "admin", "POST", "/v1/policies", {**body, "settings": {"device": "cuda"}}), 400, "invalid_value")
    _refused(_send(gw, "admin", "POST", "/v1/policies", {**body, "settings": {"lr": "fast"}}), 400, "invalid_value")
    _refused(_send(gw, "admin", "POST", "/v1/policies", {**body, "settings": {"min_sessions": 8.5}}), 400,
             "invalid_value")
    # Settings are checked together, on top of the config's trainer (batch_sessions 32).
    _refused(_send(gw, "admin", "POST", "/v1/policies", {**body, "settings": {"min_sessions": 64}}), 400,
             "invalid_policy_settings")
    _refused(_send(gw, "admin", "POST", "/v1/policies", {**body, "name": "Data Team"}), 400, "invalid_value")
    _refused(_send(gw, "admin", "POST", "/v1/policies", {**body, "name": MODEL}), 409, "policy_exists")
    _refused(_send(gw, "admin", "POST", "/v1/policies", {**body, "name": "support"}), 409, "policy_exists")
    _refused(_send(gw, "admin", "POST", "/p/data/v1/chat/completions", CHAT), 404, "policy_not_found")

    created = _send(gw, "admin", "POST", "/v1/policies", body)
    assert created.status_code == 200, created.text
    assert {k: created.json()[k] for k in ("created", "name", "training", "settings", "source")} == {
        "created": True, "name": "data", "training": "lora", "settings": body["settings"], "source": "api"}
    assert type(created.json()["settings"]["batch_sessions"]) is int
    _refused(_send(gw, "admin", "POST", "/v1/policies", body), 409, "policy_exists")
    # The default, two declared and this one fill engine.max_loras (4).
    _refused(_send(gw, "admin", "POST", "/v1/policies", {"name": "fifth"}), 409, "too_many_policies")

    reply = _send(gw, "unbound", "POST", "/p/data/v1/chat/completions", CHAT)
    assert reply.status_code == 200 and _session(gw, reply.headers["x-session-id"])["policy"] == "data"
    listed = _send(gw, "admin", "GET", "/v1/policies?policy=data").json()
    assert [p["name"] for p in listed["policies"]] == ["data"] and listed["data"] == []
    everything = _send(gw, "admin", "GET", "/v1/policies").json()
    assert {p["name"]: p["source"] for p in everything["policies"]} == {
        "default": "builtin", "support": "config", "coding": "config", "data": "api"}
    assert everything["data"][0]["version"] == 0, "the versions are listed as before"
    _refused(_send(gw, "admin", "GET", "/v1/policies?policy=nowhere"), 404, "policy_not_found")


class GatedEngine(RecordingEngine):
    """The real engine, holding each generation until the test opens the gate: a request stays between its
    session lookup and its record while the test acts as another gateway process would."""

    def __init__(self, inner: TransformersEngine) -> None:
        super().__init__(inner)
        self.entered, self.gate = threading.Event(), threading.Event()

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       affinity: Affinity | None = None) -> AsyncIterator[TokenDelta]:
        self.entered.set()
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        async for delta in super().generate(prompt_ids, params, affinity):
            yield delta


def test_a_first_call_racing_another_policys_first_call_records_nothing(
        tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path) -> None:
    """Two first calls of one session, in two policies: the one recorded second finds the session taken by the
    other policy, and is 403 `policy_forbidden` with none of its calls in it."""
    engine = GatedEngine(tiny_engine)
    running = start_gateway(engine, tiny_model_path, f"sqlite:///{tmp_path / 'race.db'}",
                            gateway={"policies": [{"name": "support"}, {"name": "coding"}]})
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{running.url}/p/support/s/race/v1/chat/completions", json=CHAT,
                                  timeout=60)
            assert engine.entered.wait(30), "the call reached the engine"
            # Meanwhile another gateway process records the session's first call, in policy coding.
            with Session(running.gateway.db) as db:
                assert queries.add_session_if_absent(db, row=queries.session_row(
                    id="race", group_id="g", owner=None, policy_version=0, model=MODEL, calls=0, tokens=0,
                    policy="coding"))
                db.commit()
            engine.gate.set()
            _refused(pending.result(), 403, "policy_forbidden")
        with Session(running.gateway.db) as db:
            stored = queries.get_session(db, session_id="race")
            assert stored is not None and stored.policy == "coding"
            assert queries.session_calls(db, session_id="race") == []
    finally:
        running.stop()
