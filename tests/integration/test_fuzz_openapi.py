"""Schemathesis fuzzes every operation of the gateway's `/openapi.json` over real HTTP (uvicorn, the
in-process tiny model, SQLite): no answer may be a 5xx, and every answer must have a status the document
declares for the operation, in the content type and body schema it declares for that status.

Generation is derandomized and bounded per operation, so a run is reproducible and takes about the same
time everywhere. A failure lists every distinct (operation, check, status) with a curl command that
repeats it.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode
from schemathesis.checks import CheckFunction
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.engines.transformers_engine import TransformersEngine

CHECKS: list[CheckFunction] = [
    schemathesis.checks.not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
MODEL = "tiny"
AGENT_KEY, ADMIN_KEY = "fuzz-agent", "fuzz-admin"
CONTEXT = 256
"""Tokens of context the tiny model gets here (its own is 2048)."""


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_path: Path) -> TransformersEngine:
    """This module's own tiny engine (the `gateway` fixture serves it), with a short context: a fuzzed
    `max_tokens` beyond it is cut at the context (`finish_reason: length`), so no case generates more than
    n × CONTEXT tokens, and a derandomized draw of `n: 16, max_tokens: 2000` cannot make the run minutes
    longer; long fuzzed prompts meet the context limit (a 400) as well. One torch thread, so that the
    engine leaves the gateway's own threads a core on a small machine."""
    engine = TransformersEngine(tiny_model_path, model_name=MODEL, threads=1)
    engine.max_len = CONTEXT
    return engine


@dataclass
class Tally:
    operations: int = 0
    cases: int = 0
    failures: dict[str, str] = field(default_factory=dict)
    """Each distinct failure (operation, check, status) once, with what came back and how to repeat it."""


def _name_the_model(case: Case, named: bool) -> Case:
    """Half the generated bodies name the served model: any other `model` is a 404 before a prompt is
    rendered, and the generating paths behind it are the ones most worth fuzzing."""
    if named and isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL
    return case


def _end_hold(gw: RunningGateway, http: requests.Session, case: Case, status: int, headers: dict[str, str]) -> None:
    """A fuzzed hold closes the generation gate for up to a day: release it, as a trainer does when its
    step ends, so that the operations fuzzed after it still generate."""
    if case.path == "/v1/generation/hold" and status == 200 and isinstance(case.body, dict):
        holder = case.body.get("holder", "trainer")
        http.post(f"{gw.url}/v1/generation/release", json={"holder": holder}, headers=headers, timeout=30)


def fuzz(gw: RunningGateway, headers: dict[str, str], examples: dict[GenerationMode, int]) -> Tally:
    """Every operation of the gateway's document, `examples[mode]` cases per generation mode."""
    schema = schemathesis.openapi.from_url(f"{gw.url}/openapi.json", config=schemathesis.Config())
    # A failure's curl command must carry the values really sent; these are fuzz data and test keys.
    schema.config.output.sanitization.update(enabled=False)
    tally = Tally()
    with requests.Session() as http:

        def run(case: Case) -> None:
            tally.cases += 1
            response = case.call(session=http, headers=headers, timeout=120)
            try:
                case.validate_response(response, checks=CHECKS, headers=headers)
            except (Failure, FailureGroup) as exc:  # keep going: every distinct failure, not only the first
                for failure in exc.exceptions if isinstance(exc, FailureGroup) else (exc,):
                    key = f"{case.operation.label}: {failure.title} ({response.status_code})"
                    tally.failures.setdefault(key, f"{failure.message}\n{response.text[:300]}\n"
                                                   f"{case.as_curl_command(headers=headers)[:1000]}")
            _end_hold(gw, http, case, response.status_code, headers)

        for result in schema.get_all_operations():
            if not isinstance(result, Ok):  # the document itself is broken there
                pytest.fail(f"an operation of /openapi.json is invalid: {result.err()}")
            operation = result.ok()
            tally.operations += 1
            # The document's own request examples, with generated path parameters and headers, join the
            # positive cases: a fuzzed body seldom gets past every rule of a prompt, and an example does.
            documented = schema.get_strategies_from_examples(operation)
            for mode, count in examples.items():
                generated = operation.as_strategy(generation_mode=mode)
                if mode is GenerationMode.POSITIVE and documented:
                    generated = st.one_of(generated, *documented)
                cases = st.builds(_name_the_model, generated, st.booleans())
                # A fixed seed per operation and mode: reproducible runs, and different cases for the three
                # paths of one handler (derandomize alone would seed every operation alike).
                test = seed(zlib.crc32(f"{operation.label} {mode.value}".encode()))(
                    settings(max_examples=count, deadline=None, derandomize=True, database=None,
                             phases=[Phase.explicit, Phase.generate],
                             suppress_health_check=list(HealthCheck))(given(case=cases)(run)))
                try:
                    test()
                except Unsatisfiable:
                    # Negative mode needs an input it can make invalid; an operation whose only inputs are
                    # free-form strings has none, and its positive cases cover it.
                    assert mode is GenerationMode.NEGATIVE, operation.label
    return tally


def _check(tally: Tally, started: float, record_property: Any, label: str) -> None:
    seconds = time.monotonic() - started
    # The counts of a run: in the output with -s (or -rP), and as properties in a JUnit XML report.
    print(f"\nfuzzed {label}: {tally.operations} operations, {tally.cases} cases, {seconds:.0f} s")
    record_property(f"{label}_operations", tally.operations)
    record_property(f"{label}_cases", tally.cases)
    assert tally.operations >= 40, "the document lost operations"
    assert not tally.failures, "\n\n".join(f"{key}\n{detail}" for key, detail in tally.failures.items())


def test_every_operation_keeps_its_documented_contract(gateway: RunningGateway, record_property: Any) -> None:
    """Without keys every caller is the admin: every route's own answers, valid and invalid input."""
    started = time.monotonic()
    tally = fuzz(gateway, {}, {GenerationMode.POSITIVE: 20, GenerationMode.NEGATIVE: 8})
    _check(tally, started, record_property, "open")


@pytest.fixture
def keyed_gateway(tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    """The same gateway with an agent key and an admin key configured (see test_access.py)."""
    running = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path / 'keyed.db'}",
                            api_keys=[AGENT_KEY], admin_key=ADMIN_KEY)
    yield running
    running.stop()


@pytest.mark.parametrize("key", [None, AGENT_KEY, ADMIN_KEY], ids=["no-key", "agent-key", "admin-key"])
def test_every_operation_keeps_its_contract_with_keys(keyed_gateway: RunningGateway, key: str | None,
                                                      record_property: Any) -> None:
    """With keys configured: no key is a documented 401 wherever one is needed, an agent key a documented 403
    on the admin's routes, and the admin key reaches every route as an owner with a fingerprint."""
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    tally = fuzz(keyed_gateway, headers, {GenerationMode.POSITIVE: 4})
    _check(tally, started, record_property, {None: "no_key", AGENT_KEY: "agent_key", ADMIN_KEY: "admin_key"}[key])


# What the fuzzer found in the generating paths, pinned: the fuzzer may draw other cases after any change.


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
