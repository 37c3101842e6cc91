"""Schemathesis fuzzes every operation of the gateway's `/openapi.json` over real HTTP (uvicorn, the
in-process tiny model, SQLite) with its own engine, the one `st run` drives: the document's examples,
coverage of each schema's boundaries, random cases, stateful sequences, and every one of its default
checks, none excluded. So no answer is a 5xx; each has a status, content type, headers and body the
document declares for it; what the document allows is accepted and what it forbids refused; a method a
path lacks is a 405 that names the ones it has.

What JSON Schema cannot state the hooks below teach the generator, one rule each, instead of any check
being loosened: a tool result answers an earlier tool call of its conversation, a forced tool call or
JSON output needs an engine with constrained decoding (the in-process one has none), and token ids are
below the model's vocabulary. Broken, each is a 400 with its own code, held by the API tests. Two rules
no generator can follow, that a prompt fits the model's context and that a reward's call belongs to the
session it names, are told apart by their answer (`STATE_AND_MODEL`); two more hooks keep the run short
and release what a fuzzed request holds.

Generation is deterministic (one seed), so a run is reproducible and takes about the same time
everywhere. A failure lists every distinct (operation, check, status) with a curl command that repeats it.
"""

from __future__ import annotations

import re
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import httpx
import pytest
import requests
import schemathesis
from schemathesis import Case, GenerationMode
from schemathesis.engine import Status, events, from_schema

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.engines.transformers_engine import TransformersEngine
from tracetrain.proxy.protocol import SEED_MAX, SEED_MIN

pytestmark = pytest.mark.slow

MODEL = "tiny"
AGENT_KEY, ADMIN_KEY, POLICY_KEY = "fuzz-agent", "fuzz-admin", "fuzz-policy-agent"
POLICY = "fuzz-policy"
"""A named policy of the fuzzed gateways, which `POLICY_KEY` is bound to: `model` names it in a quarter of the
cases, so that binding by model and key is fuzzed past its 404 (docs/api.md, "Policies"). `/p/{policy}` paths
reach a policy through the document's example, `default` (a hook that rewrote path parameters made the fuzzer
take a case with an invalid session id for a valid one)."""
POLICIES = [{"name": POLICY}]
SEED = 20261126
MAX_TOKENS, MAX_CHOICES = 4, 2
"""What a fuzzed request may make the engine generate: larger `max_tokens` and `n` are cut to these. Valid
either way, and the gateway's handling of them does not depend on their size; only the run's length does,
and the engine's token steps are most of it. Four tokens still make a stream of several chunks and text a
stop string can cut; two choices still make `n` more than one."""
CONTEXT = 512
"""Tokens of context the tiny model gets here (its own is 2048): a fuzzed prompt can be thousands of tokens,
and the prefill of one that long would take minutes. A prompt over it is a 400 `context_length_exceeded`, a
limit of the model that the document cannot state (`STATE_AND_MODEL`)."""
REPLY = "result"


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_path: Path) -> TransformersEngine:
    """This module's own tiny engine (the `gateway` fixture serves it). One torch thread, so that the engine
    leaves the gateway's own threads a core on a small machine."""
    engine = TransformersEngine(tiny_model_path, model_name=MODEL, threads=1)
    engine.max_len = CONTEXT
    return engine


@pytest.fixture
def fuzz_gateway(tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    running = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path / 'fuzz.db'}",
                            gateway={"default_max_tokens": MAX_TOKENS, "policies": POLICIES})
    yield running
    running.stop()


# --- what the document cannot state: rules for the generated data ---------------------------------------


def _chat(body: dict[str, Any]) -> None:
    """No forced call or JSON output (no constrained decoding here); a `tool` message answers an earlier
    assistant tool call, or becomes a user message."""
    if body.get("tool_choice") not in (None, "auto", "none"):
        body["tool_choice"] = "auto"
    if isinstance(body.get("response_format"), dict) and body["response_format"].get("type") != "text":
        del body["response_format"]
    called: list[str] = []
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        if message.get("role") == "assistant":
            called += [call["id"] for call in message.get("tool_calls") or [] if isinstance(call, dict)]
        elif message.get("role") == "tool" and message.get("tool_call_id") not in called:
            if called:
                message["tool_call_id"] = called[0]
            else:
                message["role"] = "user"
                message.pop("tool_call_id", None)


def _messages(body: dict[str, Any]) -> None:
    """No forced tool use (no constrained decoding here); a `tool_result` answers an earlier `tool_use`, or
    becomes text."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        body["tool_choice"] = {"type": "auto"}
    used: list[str] = []
    for message in body.get("messages") or []:
        blocks = message.get("content") if isinstance(message, dict) else None
        for index, block in enumerate(blocks if isinstance(blocks, list) else []):
            if not isinstance(block, dict):
                continue
            if block.get("type") == "tool_use":
                used.append(block.get("id"))
            elif block.get("type") == "tool_result" and block.get("tool_use_id") not in used:
                if used:
                    block["tool_use_id"] = used[0]
                else:
                    blocks[index] = {"type": "text", "text": REPLY}


def _responses(body: dict[str, Any]) -> None:
    """No forced call or JSON output (no constrained decoding here); a `function_call_output` answers an earlier
    `function_call`, or becomes a user message."""
    if body.get("tool_choice") not in (None, "auto", "none"):
        body["tool_choice"] = "auto"
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict) and text["format"].get("type") != "text":
        del text["format"]
    items = body.get("input")
    calls: list[str] = []
    for index, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        if item.get("type") == "function_call":
            calls.append(item.get("call_id"))
        elif item.get("type") == "function_call_output" and item.get("call_id") not in calls:
            if calls:
                item["call_id"] = calls[0]
            else:
                items[index] = {"role": "user", "content": REPLY}


def _completions(body: dict[str, Any], vocab: int) -> None:
    """Token ids below the vocabulary (the document cannot know the model)."""

    def below(ids: list[Any]) -> list[Any]:
        return [int(t) % vocab if isinstance(t, int | float) else t for t in ids]  # `7.0` is an integer too

    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        body["prompt"] = [below(prompt[0])]
    elif isinstance(prompt, list):
        body["prompt"] = below(prompt)


def _seed(body: dict[str, Any]) -> None:
    """Schemathesis draws integers near ±2**63 through doubles: `seed: 9223372036854775999` passes its check
    against `maximum: 9223372036854775807`. A drawn seed beyond the document's range is put back inside it."""
    seed = body.get("seed")
    if isinstance(seed, int) and not SEED_MIN <= seed <= SEED_MAX:
        body["seed"] = seed % SEED_MAX


RULES: dict[str, Callable[[dict[str, Any]], None]] = {
    "/v1/chat/completions": _chat, "/v1/messages": _messages, "/v1/messages/count_tokens": _messages,
    "/v1/responses": _responses}


def _bounded(body: dict[str, Any]) -> None:
    """Valid `max_tokens` and `n` cut to what keeps the run short; an invalid one (a negative case's) stays. An
    integral float (`14.0`) is valid too: left uncut, `n: 14.0, max_tokens: 18638.0` had the one-thread engine
    sample 14 choices to the end of the context, past the client's read timeout."""
    for key, most, cut in (("max_tokens", 131072, MAX_TOKENS), ("max_completion_tokens", 131072, MAX_TOKENS),
                           ("max_output_tokens", 131072, MAX_TOKENS), ("n", 16, MAX_CHOICES)):
        value = body.get(key)
        integral = isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer()
        if integral and cut < value <= most:
            body[key] = cut


def _prepare(case: Case, vocab: int) -> Case:
    body = case.body
    if not isinstance(body, dict):
        return case
    # Half the bodies name the served model and a quarter the policy: any other `model` is a 404 before a prompt
    # is rendered, and the generating paths behind it are the ones most worth fuzzing. Chosen by the body, so
    # deterministic.
    if isinstance(body.get("model"), str):
        body["model"] = {1: MODEL, 2: POLICY, 3: MODEL}.get(zlib.crc32(repr(sorted(body)).encode()) % 4,
                                                            body["model"])
    _bounded(body)
    if case.meta is not None and case.meta.generation.mode is GenerationMode.POSITIVE:
        for suffix, rule in RULES.items():
            if case.path.endswith(suffix):
                rule(body)
        if case.path.endswith("/v1/completions"):
            _completions(body, vocab)
        _seed(body)
    return case


STATE_AND_MODEL = {
    "context_length_exceeded": "the rendered prompt is longer than the model's context",
    "session_mismatch": "a reward names a real call (the stateful phase reuses ids from earlier answers) and "
                        "another session",
    "invalid_policy_settings": "a new policy's settings are checked together on top of the config's trainer "
                               "(min_sessions within batch_sessions), which the document types one by one",
}
"""Valid requests refused for what no document can state: a limit of the model, and the state of the store. Told
apart by their answer, a 400 with one of these codes."""
OVER_THE_CONTEXT = re.compile(r"prompt of \d+ tokens exceeds the context of \d+")
"""The same refusal in Anthropic's shape, which has no code."""


def _beyond_the_document(failure: Any, response: Any) -> bool:
    if failure.title != "Schema-valid request rejected" or response.status_code != 400:
        return False
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return error.get("code") in STATE_AND_MODEL or bool(OVER_THE_CONTEXT.fullmatch(error.get("message", "")))


# --- the run ------------------------------------------------------------------------------------------------


@dataclass
class Tally:
    operations: set[str] = field(default_factory=set)
    cases: int = 0
    beyond_the_document: int = 0
    """Valid requests refused by a rule of the model or the store's state (`STATE_AND_MODEL`)."""
    failures: dict[str, str] = field(default_factory=dict)
    """Each distinct failure (operation, check, status) once, with what came back and how to repeat it."""


def fuzz(gw: RunningGateway, headers: dict[str, str], *, max_examples: int, phases: list[str] | None = None) -> Tally:
    """Schemathesis' engine over the gateway's document: `phases` (default: all), every default check."""
    schema = schemathesis.openapi.from_url(f"{gw.url}/openapi.json", config=schemathesis.Config())
    schema.config.seed = SEED
    # A failure's curl command must carry the values really sent; these are fuzz data and test keys.
    schema.config.output.sanitization.update(enabled=False)
    schema.config.update(headers=headers or None, workers=1, request_timeout=120)
    schema.config.generation.update(max_examples=max_examples, deterministic=True, database="none")
    if phases is not None:
        schema.config.phases.update(phases=phases)
    vocab = gw.gateway.renderer.vocab_size
    tally = Tally()

    @schema.hook
    def map_case(context: Any, case: Case) -> Case:
        return _prepare(case, vocab)

    @schema.hook
    def filter_failure(context: Any, failure: Any, case: Case, response: Any) -> bool:
        if _beyond_the_document(failure, response):
            tally.beyond_the_document += 1
            return False
        return True

    @schema.hook
    def after_call(context: Any, case: Case, response: Any) -> None:
        # A fuzzed hold closes the generation gate for up to a day: release it, as a trainer does when its
        # step ends, so that the operations fuzzed after it still generate.
        if case.path == "/v1/generation/hold" and response.status_code == 200:
            holder = case.body.get("holder", "trainer") if isinstance(case.body, dict) else "trainer"
            requests.post(f"{gw.url}/v1/generation/release", json={"holder": holder}, headers=headers, timeout=30)

    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            _record(tally, event.recorder)
        elif isinstance(event, events.NonFatalError):
            # The phase and the request that repeats it: a timeout's message alone names neither.
            message = f"{event.info.message} (phase: {event.phase})\n{event.info.code_sample or ''}"
            tally.failures.setdefault(f"{event.label}: error", message[:3000])
        elif isinstance(event, events.FatalError):
            tally.failures.setdefault("run: error", repr(event.exception)[:2000])
        elif isinstance(event, events.EngineFinished):
            for failure in event.failures:
                tally.failures.setdefault(f"run: {failure.title}", failure.message[:2000])
    return tally


def _record(tally: Tally, recorder: Any) -> None:
    if recorder.label != "Stateful tests":  # sequences of the operations, not one of its own
        tally.operations.add(recorder.label)
    tally.cases += len(recorder.cases)
    for case_id, checks in recorder.checks.items():
        for check in checks:
            if check.status != Status.FAILURE or check.failure_info is None:
                continue
            interaction = recorder.interactions.get(case_id)
            response = interaction.response if interaction is not None else None
            status = response.status_code if response is not None else None
            info = check.failure_info
            text = (response.content or b"")[:300].decode(errors="replace") if response is not None else ""
            detail = f"{info.failure.title}: {info.failure.message}\n{text}\n{info.code_sample[:1500]}"
            tally.failures.setdefault(f"{recorder.label}: {check.name} ({status})", detail)


def _check(tally: Tally, started: float, record_property: Any, label: str) -> None:
    seconds = time.monotonic() - started
    # The counts of a run: in the output with -s (or -rP), and as properties in a JUnit XML report.
    print(f"\nfuzzed {label}: {len(tally.operations)} operations, {tally.cases} cases ({tally.beyond_the_document} "
          f"refused by the model's or the store's state), {seconds:.0f} s")
    record_property(f"{label}_operations", len(tally.operations))
    record_property(f"{label}_cases", tally.cases)
    assert len(tally.operations) >= 40, "the document lost operations"
    assert not tally.failures, "\n\n".join(f"{key}\n{detail}" for key, detail in tally.failures.items())


def test_every_operation_keeps_its_documented_contract(fuzz_gateway: RunningGateway, record_property: Any) -> None:
    """Without keys every caller is the admin: every route's own answers, valid and invalid input, every phase."""
    started = time.monotonic()
    _check(fuzz(fuzz_gateway, {}, max_examples=5), started, record_property, "open")


@pytest.fixture
def keyed_gateway(tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    """The same gateway with an agent key, an agent key bound to a policy and an admin key configured (see
    test_access.py, test_policies.py)."""
    running = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path / 'keyed.db'}",
                            gateway={"api_keys": [AGENT_KEY, {"key": POLICY_KEY, "policy": POLICY}],
                                     "admin_key": ADMIN_KEY, "default_max_tokens": MAX_TOKENS, "policies": POLICIES})
    yield running
    running.stop()


@pytest.mark.parametrize("key", [None, AGENT_KEY, POLICY_KEY, ADMIN_KEY],
                         ids=["no-key", "agent-key", "policy-key", "admin-key"])
def test_every_operation_keeps_its_contract_with_keys(keyed_gateway: RunningGateway, key: str | None,
                                                      record_property: Any) -> None:
    """With keys configured: no key is a documented 401 wherever one is needed, an agent key a documented 403
    on the admin's routes (and a key bound to a policy a documented 403 on another policy's), and the admin key
    reaches every route as an owner with a fingerprint. The examples
    and random cases only: the coverage phase's boundaries do not depend on the key."""
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    tally = fuzz(keyed_gateway, headers, max_examples=3, phases=["examples", "fuzzing"])
    _check(tally, started, record_property,
           {None: "no_key", AGENT_KEY: "agent_key", POLICY_KEY: "policy_key", ADMIN_KEY: "admin_key"}[key])


# What the fuzzer found, pinned: the fuzzer may draw other cases after any change.


def test_a_session_id_beyond_ascii_comes_back_percent_encoded(gateway: RunningGateway) -> None:
    """A session id a header cannot hold (it holds Latin-1 at most) made the answer a 500."""
    session = "会话-é 50%"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for stream in (False, True):
        response = httpx.post(f"{gateway.url}/s/{quote(session, safe='')}/v1/chat/completions",
                              json={**body, "stream": stream}, timeout=60)
        assert response.status_code == 200, response.text
        assert response.headers["x-session-id"] == "%E4%BC%9A%E8%AF%9D-%C3%A9 50%25"
        assert unquote(response.headers["x-session-id"]) == session
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json={**body, "user": session}, timeout=60)
    assert reply.status_code == 200 and reply.json()["session_id"] == session


def test_a_seed_beyond_64_bits_is_a_400(gateway: RunningGateway) -> None:
    """The in-process engine's generator takes no such seed: that was a 502."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"model": MODEL, "prompt": "hi",
                                                                            "max_tokens": 2})):
        for bad in (2**63, -(2**63) - 1):
            response = httpx.post(gateway.url + path, json={**body, "seed": bad}, timeout=60)
            assert response.status_code == 400 and response.json()["error"]["param"] == "seed", response.text
        assert httpx.post(gateway.url + path, json={**body, "seed": 2**63 - 1}, timeout=60).status_code == 200
