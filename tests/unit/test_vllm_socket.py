"""The self-started vLLM's address: a Unix socket in a private directory, and every client that reaches
it over that socket (engine, publishers, health checks), without starting vLLM (the real server is in
tests/integration/test_vllm_exposure.py)."""

from __future__ import annotations

import asyncio
import gc
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web
from pydantic import ValidationError
from safetensors.numpy import save_file

from tracetrain.config import load_config
from tracetrain.engines.publishing import Checkpoint
from tracetrain.engines.vllm import VLLMEngine
from tracetrain.engines.vllm_publish import VLLMLoRAPublisher
from tracetrain.engines.vllm_server import VLLMServer, async_http_client, engine_address, http_client


def test_engine_urls_parse_in_one_place() -> None:
    assert engine_address("http://h:8000/v1/") == engine_address("http://h:8000")
    assert engine_address("http://h:8000").uds is None
    unix = engine_address("unix:/run/x/vllm.sock")
    assert (unix.url, unix.uds, unix.http_base) == ("unix:/run/x/vllm.sock", "/run/x/vllm.sock", "http://localhost")
    for bad in ("h:8000", "unix:relative.sock", "ftp://h", "http://"):
        with pytest.raises(ValueError, match="engine URL"):
            engine_address(bad)


def test_config_checks_engine_urls_and_the_listen_switch() -> None:
    assert load_config(engine={"urls": "unix:/run/x/vllm.sock"}).engine.urls == ["unix:/run/x/vllm.sock"]
    assert load_config().engine.vllm_listen == "socket"
    with pytest.raises(ValidationError, match="engine URL"):
        load_config(engine={"urls": ["gpu-box:8000"]})
    with pytest.raises(ValidationError, match="vllm_listen"):
        load_config(engine={"vllm_listen": "udp"})


def test_a_socket_server_listens_in_a_private_directory_and_no_port() -> None:
    server = VLLMServer("/models/m", python="python")
    assert server.socket_path is not None
    directory = server.socket_path.parent
    info = directory.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    assert server.url == f"unix:{server.socket_path}"
    cmd = server.command()
    assert cmd[cmd.index("--uds") + 1] == str(server.socket_path)
    assert "--port" not in cmd and "--host" not in cmd
    del server
    gc.collect()
    assert not directory.exists()  # the directory goes with the server object

    tcp = VLLMServer("/models/m", python="python", listen="tcp", port=8123)
    assert (tcp.socket_path, tcp.url) == (None, "http://127.0.0.1:8123")
    assert "--uds" not in tcp.command() and "8123" in tcp.command()


@pytest.fixture
async def fake_vllm(tmp_path: Path) -> AsyncIterator[str]:
    """Enough of vLLM's API on a Unix socket for the clients: health, models, LoRA loading."""
    loaded: list[str] = []

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": name} for name in ["m", *loaded]]})

    async def load(request: web.Request) -> web.Response:
        loaded.append((await request.json())["lora_name"])
        return web.Response(text="ok")

    async def ok(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    path = tmp_path / "vllm.sock"
    await web.UnixSite(runner, str(path)).start()
    yield f"unix:{path}"
    await runner.cleanup()


@pytest.mark.asyncio(loop_scope="session")
async def test_every_client_reaches_a_socket(fake_vllm: str, tmp_path: Path) -> None:
    engine = VLLMEngine(fake_vllm, "m")
    assert await engine.health()
    async with async_http_client(fake_vllm, timeout=5) as client:
        assert (await client.get("/health")).status_code == 200

    def sync_health() -> int:  # in a thread: the server runs on this loop
        with http_client(fake_vllm, timeout=5) as sync_client:
            return sync_client.get("/health").status_code

    assert await asyncio.to_thread(sync_health) == 200
    adapter = tmp_path / "v1"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    save_file({"lora_A": np.zeros((8, 4), np.float32)}, str(adapter / "adapter_model.safetensors"))
    publisher = VLLMLoRAPublisher(engine, prefix="p")
    await publisher.publish(Checkpoint(1, adapter, "lora"))
    assert await publisher.is_loaded(Checkpoint(1, adapter, "lora"))
    assert (engine.served_model, engine.version) == ("p-v1", 1)
    await engine.close()
