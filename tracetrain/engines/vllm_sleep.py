"""vLLM's sleep mode, for a GPU that vLLM shares with the trainer in `sync` mode.

Level 1 moves the weights to host memory and drops the KV cache, so a training step gets the GPU's
memory; waking puts the weights back and rebuilds the cache. Both are development endpoints of a server
started with `--enable-sleep-mode` and `VLLM_SERVER_DEV_MODE=1` (engines/vllm_server.py sets the
latter), and exist on CUDA builds only.
"""

from __future__ import annotations

import httpx

from tracetrain.engines.vllm_server import async_http_client


class SleepError(RuntimeError):
    pass


async def _post(base_url: str, path: str, timeout: float) -> None:
    # A new connection per call, as for the other control endpoints (engines/vllm_publish.py).
    async with async_http_client(base_url, timeout=timeout,
                                 limits=httpx.Limits(max_keepalive_connections=0)) as client:
        response = await client.post(path)
    if response.status_code != 200:
        raise SleepError(f"vLLM at {base_url} answered {response.status_code} to {path}: {response.text[:300]}")


async def sleep(base_url: str, *, level: int = 1, timeout: float = 300.0) -> None:
    """Put the server to sleep; it must have no request running (the gateway drains it first)."""
    await _post(base_url, f"/sleep?level={level}", timeout)


async def wake_up(base_url: str, *, timeout: float = 300.0) -> None:
    """Weights first, then the KV cache: the weights' copy back never meets a full cache on the GPU."""
    await _post(base_url, "/wake_up?tags=weights", timeout)
    await _post(base_url, "/wake_up?tags=kv_cache", timeout)
