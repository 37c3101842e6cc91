from __future__ import annotations

import os
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


@pytest.fixture(scope="session")
def vllm_server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningVLLM]:
    """A real vLLM server (CPU) on SmolLM2-135M-Instruct, started once per session (about 80 s).

    LoRA hot-loading and the dev endpoints (pause, reload) are on, so the publish tests share this one
    server with the engine and gateway tests; the publish tests put the base weights back when done.
    Set TRACETRAIN_TEST_VLLM_URL to reuse a server you already started (same model, max-model-len
    4096, `--enable-lora --max-lora-rank 16`, `VLLM_SERVER_DEV_MODE=1`; `http://host:port` or
    `unix:/path/to/socket`) and skip the start-up while iterating.
    """
    from tracetrain.engines.vllm_server import VLLMServer, engine_address, find_vllm_python, http_client

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
    server = VLLMServer(
        smollm2_path,
        served_model_name="smollm2",
        max_model_len=VLLM_MAX_MODEL_LEN,
        kv_cache_gib=2,
        enable_lora=True,
        max_lora_rank=VLLM_MAX_LORA_RANK,
        log_path=tmp_path_factory.mktemp("vllm") / "vllm.log",
    )
    with server:
        yield RunningVLLM(server.url, server.model_name, VLLM_MAX_MODEL_LEN, smollm2_path, server)


@pytest.fixture
def vllm_gateway(vllm_server: RunningVLLM, smollm2_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    """A real gateway over HTTP in front of the shared vLLM server, recording what the engine sees."""
    from tracetrain.engines.vllm import VLLMEngine

    engine = RecordingEngine(VLLMEngine(vllm_server.url, vllm_server.model_name, timeout=120))
    running = start_gateway(engine, smollm2_path, f"sqlite:///{tmp_path / 'vllm.db'}")
    yield running
    running.stop()
