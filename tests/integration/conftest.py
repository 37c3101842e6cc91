from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tests.support.setup_steps import VLLM_MISSING

if TYPE_CHECKING:
    from tracetrain.engines.vllm_server import VLLMServer


@dataclass
class RunningVLLM:
    url: str
    """`unix:/path/to/socket` for the server started here (see `VLLMServer`); reach it with
    `http_client`/`async_http_client` from `tracetrain.engines.vllm_server`."""
    model_name: str
    max_model_len: int
    model_dir: Path
    """The directory the server loaded its weights from (weight-reload tests restore it)."""
    server: VLLMServer | None = None
    """The server when the fixture started it (None for one reused from TRACETRAIN_TEST_VLLM_URL)."""


VLLM_MAX_MODEL_LEN = 4096
VLLM_MAX_LORA_RANK = 16


def _shared_server(model_dir: Path, log_dir: Path) -> VLLMServer:
    from tracetrain.engines.vllm_server import VLLMServer
    from tracetrain.engines.weight_transfer import server_config

    return VLLMServer(
        model_dir,
        served_model_name="smollm2",
        max_model_len=VLLM_MAX_MODEL_LEN,
        kv_cache_gib=2,
        enable_lora=True,
        max_lora_rank=VLLM_MAX_LORA_RANK,
        extra_args=server_config("shm")[0],  # full weights from memory (test_publish.py)
        log_path=log_dir / "vllm.log",
    )


LAUNCHED = pytest.StashKey["VLLMServer"]()
LOG_DIR = pytest.StashKey[Path]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Launch the shared vLLM server as soon as the run is known to need it, without waiting for it: its
    start-up, mostly single-threaded imports, then overlaps the tests that run before the first one
    that uses it, instead of stalling that test. `vllm_server` waits for it to be healthy."""
    if session.config.option.collectonly or os.environ.get("TRACETRAIN_TEST_VLLM_URL"):
        return
    if not any("vllm_server" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    from tracetrain.engines.models import smollm2_dir
    from tracetrain.engines.vllm_server import find_vllm_python

    if find_vllm_python() is None:
        return  # `vllm_server` skips, naming the setup step
    log_dir = Path(tempfile.mkdtemp(prefix="tracetrain-test-vllm-"))
    server = _shared_server(smollm2_dir(), log_dir)
    server.launch()
    session.config.stash[LAUNCHED] = server
    session.config.stash[LOG_DIR] = log_dir


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the launched server (the fixture stops it too when it was used); its log stays if the run failed."""
    server = session.config.stash.get(LAUNCHED, None)
    if server is not None:
        server.stop()
        if exitstatus == 0:
            shutil.rmtree(session.config.stash[LOG_DIR], ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_server(request: pytest.FixtureRequest, smollm2_path: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningVLLM]:
    """A real vLLM server (CPU) on SmolLM2-135M-Instruct, shared by the whole session: launched when
    collection ends (`pytest_collection_finish`), waited for here.

    LoRA hot-loading and the dev endpoints (pause, reload) are on, so the publish tests share this one
    server with the engine and gateway tests; the publish tests put the base weights back when done.
    Set TRACETRAIN_TEST_VLLM_URL to reuse a server you already started (same model, max-model-len
    4096, `--enable-lora --max-lora-rank 16`, `VLLM_SERVER_DEV_MODE=1`; `http://host:port` or
    `unix:/path/to/socket`) and skip the start-up while iterating.
    """
    from tracetrain.engines.vllm_server import engine_address, find_vllm_python, http_client

    existing = os.environ.get("TRACETRAIN_TEST_VLLM_URL")
    if existing:
        url = engine_address(existing).url
        with http_client(url, timeout=10) as client:
            models = client.get("/v1/models").json()["data"]
        first = next(m for m in models if m.get("parent") is None)  # not a LoRA adapter loaded earlier
        yield RunningVLLM(url, first["id"], first.get("max_model_len", 0), Path(first["root"]))
        return
    if find_vllm_python() is None:
        pytest.skip(VLLM_MISSING)
    server = request.config.stash.get(LAUNCHED, None)
    if server is None:  # a run whose collection did not ask for it (a test requested it dynamically)
        server = _shared_server(smollm2_path, tmp_path_factory.mktemp("vllm"))
        server.launch()
    try:
        server.wait_healthy()
        yield RunningVLLM(server.url, server.model_name, VLLM_MAX_MODEL_LEN, smollm2_path, server)
    finally:
        server.stop()


def put_base_weights_back(server: RunningVLLM) -> None:
    """Reload the shared server's own weights (paused, so no request sees half of them)."""
    from tracetrain.engines.vllm_server import http_client

    body = {"method": "reload_weights", "kwargs": {"weights_path": str(server.model_dir)}}
    with http_client(server.url, timeout=300) as client:
        client.post("/pause", params={"mode": "wait"})
        try:
            assert client.post("/collective_rpc", json=body).status_code == 200
            client.post("/reset_prefix_cache")
        finally:
            client.post("/resume")


@pytest.fixture(scope="module")
def restore_base_weights(vllm_server: RunningVLLM) -> Iterator[None]:
    """The server is shared with other test modules: a module that publishes into it puts its original
    weights back afterwards."""
    yield
    put_base_weights_back(vllm_server)


@pytest.fixture
def vllm_gateway(vllm_server: RunningVLLM, smollm2_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    """A real gateway over HTTP in front of the shared vLLM server, recording what the engine sees."""
    from tracetrain.engines.vllm import VLLMEngine

    engine = RecordingEngine(VLLMEngine(vllm_server.url, vllm_server.model_name, timeout=120))
    running = start_gateway(engine, smollm2_path, f"sqlite:///{tmp_path / 'vllm.db'}")
    yield running
    running.stop()
