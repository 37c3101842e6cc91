"""Publishing to a vLLM server while agents keep running.

- `VLLMLoRAPublisher`: `POST /v1/load_lora_adapter` under a new name per version, then the engine
  names that adapter in new requests. Requests already sent keep their adapter, so nothing waits.
- `VLLMReloadPublisher`: full weights in place: `POST /pause?mode=wait` (in-flight requests finish on
  the old weights, new ones queue inside vLLM) → `POST /collective_rpc` `reload_weights` with
  `weights_path` pointing at the checkpoint → `POST /reset_prefix_cache` → `POST /resume`.

This matters most for the reload: vLLM 0.32 moves every layer to the meta device before reading the
files, so a reload that fails halfway (a missing or truncated file) leaves an engine that dies on its
next request. The reload publisher therefore validates the safetensors headers against the served
model first, and if vLLM still fails it reloads the last good weights before resuming.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import httpx

from tracetrain.config import DEFAULT_POLICY
from tracetrain.engines.publishing import (
    Checkpoint,
    PublishError,
    TensorIndex,
    check_full_checkpoint,
    check_lora_checkpoint,
    check_weights,
    expect_kind,
    model_shapes,
)
from tracetrain.engines.vllm_server import async_http_client

if TYPE_CHECKING:
    from tracetrain.engines.vllm import VLLMEngine

log = logging.getLogger(__name__)


def _control_client(engine: VLLMEngine, timeout: float) -> httpx.AsyncClient:
    """A client for vLLM's control endpoints that opens a new connection per call: after a failed
    `/collective_rpc` (a 500), vLLM 0.32's server drops the keep-alive connection, and the next call
    sent on it (the restore, `/resume`) would fail without reaching the server."""
    return async_http_client(engine.base_url, timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0))


def _vllm_message(response: httpx.Response) -> str:
    try:
        body = response.json()
        message = body.get("error", body)
        if isinstance(message, dict):
            message = message.get("message", message)
        return str(message)[:500]
    except ValueError:
        return response.text[:500]


class VLLMLoRAPublisher:
    """Publishes LoRA adapters to a vLLM server started with `--enable-lora` (and
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`), as `{prefix}-v{version}`.

    After the switch, adapters older than the previous one are unloaded. Unloading in vLLM 0.32 only
    forgets the name in the API server: requests already running hold their adapter and finish (the
    engine reloads it from its path if its LRU cache evicted it, so keep the last few checkpoint
    directories on disk), and the engine's cache bounds memory on its own.
    """

    def __init__(self, engine: VLLMEngine, *, prefix: str = "policy", timeout: float = 120.0) -> None:
        self.engine = engine
        self.prefix = prefix
        self.timeout = timeout
        self.loaded: list[str] = []
        """Adapter names this publisher loaded and has not unloaded, oldest first."""
        self._lock = asyncio.Lock()

    def adapter_name(self, version: int) -> str:
        return f"{self.prefix}-v{version}"

    async def publish(self, checkpoint: Checkpoint) -> None:
        async with self._lock:
            await self.load(checkpoint)
            self.switch(checkpoint)
            await self.tidy()

    async def load(self, checkpoint: Checkpoint) -> None:
        """Load the adapter into vLLM without serving it yet (a replica set loads every replica first)."""
        expect_kind(checkpoint, "lora", type(self).__name__)
        check_lora_checkpoint(checkpoint.path)
        async with _control_client(self.engine, self.timeout) as client:
            await self._load(client, self.adapter_name(checkpoint.version), checkpoint.path)

    async def is_loaded(self, checkpoint: Checkpoint) -> bool:
        """Whether vLLM already holds this version's adapter, of any line (another gateway process loaded it)."""
        async with _control_client(self.engine, self.timeout) as client:
            try:
                response = await client.get("/v1/models")
                names = {m.get("id") for m in response.json().get("data", [])}
            except (httpx.HTTPError, ValueError, AttributeError):
                return False
        return self.adapter_for(checkpoint) in names

    def adapter_for(self, checkpoint: Checkpoint) -> str:
        """The adapter name of a version of any line."""
        return self.adapter_name(checkpoint.version) if checkpoint.line == DEFAULT_POLICY else \
            self.line_adapter(checkpoint)

    def switch(self, checkpoint: Checkpoint) -> None:
        """Serve a loaded adapter from the next request on (no await: atomic for the event loop)."""
        name = self.adapter_name(checkpoint.version)
        self.engine.use_adapter(name, checkpoint.version)
        if name in self.loaded:
            self.loaded.remove(name)
        self.loaded.append(name)
        log.info("serving LoRA %s (version %d) from %s", name, checkpoint.version, checkpoint.path)

    def line_adapter(self, checkpoint: Checkpoint) -> str:
        """A named policy's version as its own adapter name, next to every other line's."""
        return self._line_name(checkpoint.line, checkpoint.version)

    def _line_name(self, line: str, version: int) -> str:
        return f"{self.prefix}-{line}-v{version}"

    async def publish_line(self, checkpoint: Checkpoint) -> None:
        """A named policy's version, served to that policy's requests from the next one on; every other line
        is left as it was. The base weights stay the base model's (named policies need LoRA publishing)."""
        await self.load_line(checkpoint)
        await self.switch_line(checkpoint)

    async def load_line(self, checkpoint: Checkpoint) -> None:
        expect_kind(checkpoint, "lora", type(self).__name__)
        check_lora_checkpoint(checkpoint.path)
        async with _control_client(self.engine, self.timeout) as client:
            await self._load(client, self.line_adapter(checkpoint), checkpoint.path)

    async def switch_line(self, checkpoint: Checkpoint) -> None:
        """Serve a loaded line adapter, then unload the policy's previous one (best effort: requests already
        sent hold their adapter and finish, see the class docstring)."""
        previous = self.engine.lines.get(checkpoint.line)
        self.engine.use_line(checkpoint.line, self.line_adapter(checkpoint), checkpoint.version)
        log.info("serving LoRA %s (policy %r) from %s", self.line_adapter(checkpoint), checkpoint.line,
                 checkpoint.path)
        if previous is None or previous[1] == self.line_adapter(checkpoint):
            return
        async with _control_client(self.engine, self.timeout) as client:
            try:
                await client.post("/v1/unload_lora_adapter", json={"lora_name": previous[1]})
            except httpx.HTTPError as exc:
                log.warning("unloading LoRA %s failed: %s", previous[1], exc)

    async def tidy(self) -> None:
        """Unload adapters older than the previous one (best effort); a staged canary is not among them."""
        async with _control_client(self.engine, self.timeout) as client:
            await self._unload_all_but(client, keep=2)

    # --- canary promotion: a version served next to the current one ---------------------------------

    async def stage(self, checkpoint: Checkpoint) -> None:
        """Load a version for the requests that ask for it by version (of its line); the line's current one
        stays the default."""
        if checkpoint.line != DEFAULT_POLICY:
            await self.load_line(checkpoint)
            self.engine.line_canaries[(checkpoint.line, checkpoint.version)] = self.line_adapter(checkpoint)
            log.info("LoRA %s loaded as a canary", self.line_adapter(checkpoint))
            return
        await self.load(checkpoint)
        self.engine.adapters[checkpoint.version] = self.adapter_name(checkpoint.version)
        log.info("LoRA %s (version %d) loaded as a canary", self.adapter_name(checkpoint.version), checkpoint.version)

    async def promote(self, checkpoint: Checkpoint) -> None:
        """Serve a version (staged or not) to every request of its line from now on."""
        if checkpoint.line != DEFAULT_POLICY:
            if self.engine.line_canaries.pop((checkpoint.line, checkpoint.version), None) is None:
                await self.load_line(checkpoint)
            await self.switch_line(checkpoint)
            return
        async with self._lock:
            if checkpoint.version not in self.engine.adapters:
                await self.load(checkpoint)
            self.switch(checkpoint)
            await self.tidy()

    async def retire(self, version: int, line: str = DEFAULT_POLICY) -> None:
        """Stop serving a staged version: requests asking for it get the line's current one (best effort
        unload)."""
        if line != DEFAULT_POLICY:
            name = self.engine.line_canaries.pop((line, version), None) or self._line_name(line, version)
        else:
            self.engine.adapters.pop(version, None)
            name = self.adapter_name(version)
        async with _control_client(self.engine, self.timeout) as client:
            try:
                await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
            except httpx.HTTPError as exc:
                log.warning("unloading LoRA %s failed: %s", name, exc)

    async def _load(self, client: httpx.AsyncClient, name: str, path: Path) -> None:
        # load_inplace: a trainer that restarts and publishes the same version again replaces it
        # instead of failing on "already loaded".
        body = {"lora_name": name, "lora_path": str(path.resolve()), "load_inplace": True}
        try:
            response = await client.post("/v1/load_lora_adapter", json=body)
        except httpx.HTTPError as exc:
            raise PublishError(f"loading LoRA {name} from {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise PublishError(
                f"vLLM refused LoRA {name} from {path} ({response.status_code}): {_vllm_message(response)}"
            )

    async def _unload_all_but(self, client: httpx.AsyncClient, keep: int) -> None:
        """Best effort: the new version is already served, so a failed unload is only logged."""
        while len(self.loaded) > keep:
            name = self.loaded.pop(0)
            version = int(name.rsplit("-v", 1)[1])
            if self.engine.adapters.get(version) == name:
                self.engine.adapters.pop(version)  # sessions pinned to it move to the served version
            try:
                response = await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
                if response.status_code not in (200, 404):
                    log.warning("unloading LoRA %s failed (%d): %s", name, response.status_code,
                                _vllm_message(response))
            except httpx.HTTPError as exc:
                log.warning("unloading LoRA %s failed: %s", name, exc)


PauseMode = Literal["wait", "keep"]


class VLLMReloadPublisher:
    """Publishes full checkpoints by reloading a dev-mode vLLM server's weights in place
    (`VLLM_SERVER_DEV_MODE=1`, which `VLLMServer` sets).

    `reload_weights` takes `weights_path` in vLLM 0.32, so vLLM reads the checkpoint directory itself;
    nothing is copied into `server_model_dir`, which serves as the reference the checkpoint must match
    and as the weights to fall back to if a reload fails halfway.

    `pause_mode="wait"` (default) lets in-flight requests finish on the old weights before the
    reload: every generation comes from one version, but the swap waits for the longest running
    request. `"keep"` freezes them and continues them on the new weights after `/resume` (faster swap,
    mixed-version generations). vLLM's default, `"abort"`, ends them early with finish_reason `abort`,
    so it is not offered.

    With `transfer` (a weight-transfer backend the server was started with, engines/weight_transfer.py), a
    checkpoint that carries its weights in memory is sent from there; its directory is the fallback when
    the transfer fails. `last_route` says which way the last version went.
    """

    pauses_engine = True
    """Tells the gateway to hold new generations while this publisher swaps the weights."""

    def __init__(
        self,
        engine: VLLMEngine,
        server_model_dir: str | Path,
        *,
        pause_mode: PauseMode = "wait",
        drain_timeout: float = 600.0,
        reload_timeout: float = 300.0,
        transfer: str | None = None,
    ) -> None:
        self.engine = engine
        self.transfer = transfer
        self.last_route: Literal["memory", "disk"] | None = None
        self.server_model_dir = Path(server_model_dir)
        self.pause_mode = pause_mode
        self.drain_timeout = drain_timeout
        self.reload_timeout = reload_timeout
        self.current_weights = self.server_model_dir
        """The directory vLLM's weights last came from: where to reload from if a reload fails."""
        self._reference: TensorIndex | None = None
        self._lock = asyncio.Lock()

    async def publish(self, checkpoint: Checkpoint) -> None:
        expect_kind(checkpoint, "full", type(self).__name__)
        if self._reference is None:
            self._reference = model_shapes(self.server_model_dir)
        check_full_checkpoint(checkpoint.path, self._reference)
        async with self._lock, _control_client(self.engine, 60.0) as client:
            await self._pause(client)
            try:
                await self._reload_or_restore(client, checkpoint)
                self.engine.use_adapter(None, checkpoint.version)  # the new weights are live from here
                await self._reset_prefix_cache(client)
            finally:
                await self._resume(client)
        log.info("serving full checkpoint version %d (%s: %s)", checkpoint.version,
                 "sent from memory" if self.last_route == "memory" else "reloaded from", checkpoint.path)

    async def _pause(self, client: httpx.AsyncClient) -> None:
        """Returns once vLLM has stopped scheduling: with "wait", after in-flight requests finished."""
        try:
            params = {"mode": self.pause_mode}
            response = await client.post("/pause", params=params, timeout=self.drain_timeout)
        except httpx.HTTPError as exc:
            await self._resume(client)  # a pause that timed out is still pending inside vLLM
            raise PublishError(f"pausing vLLM failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            await self._resume(client)
            raise PublishError(f"pausing vLLM failed ({response.status_code}): {_vllm_message(response)}")

    async def _reload_or_restore(self, client: httpx.AsyncClient, checkpoint: Checkpoint) -> None:
        if self.transfer is not None and checkpoint.weights is not None:
            from tracetrain.engines import weight_transfer

            source = checkpoint.weights
            try:
                weights = await asyncio.to_thread(lambda: list(source()))  # a merge would stall the loop
                assert self._reference is not None  # read by `publish` before the pause
                check_weights(weights, self._reference)
                async with _control_client(self.engine, self.reload_timeout) as transfer_client:
                    await weight_transfer.send(transfer_client, weights, self.transfer)
                self.current_weights, self.last_route = checkpoint.path, "memory"
                return
            except Exception as exc:  # the checkpoint on disk is the fallback, whatever went wrong here
                log.error("sending version %d from memory failed, reloading it from %s: %s", checkpoint.version,
                          checkpoint.path, exc)
        try:
            await self._reload(client, checkpoint.path)
        except PublishError as exc:
            log.error("reload of version %d failed, restoring %s: %s", checkpoint.version,
                      self.current_weights, exc)
            try:
                await self._reload(client, self.current_weights)
            except PublishError as restore_exc:
                raise PublishError(f"{exc}; restoring the previous weights also failed, vLLM may be "
                                   f"unusable: {restore_exc}") from exc
            raise
        self.current_weights, self.last_route = checkpoint.path, "disk"

    async def _reload(self, client: httpx.AsyncClient, weights: Path) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(weights.resolve())},
                "timeout": self.reload_timeout}
        try:
            response = await client.post("/collective_rpc", json=body, timeout=self.reload_timeout + 10)
        except httpx.HTTPError as exc:
            raise PublishError(f"reloading weights from {weights}: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 404:
            raise PublishError("vLLM has no /collective_rpc: start it with VLLM_SERVER_DEV_MODE=1")
        if response.status_code != 200:
            raise PublishError(
                f"vLLM failed to reload weights from {weights} ({response.status_code}): "
                f"{_vllm_message(response)}"
            )

    async def _reset_prefix_cache(self, client: httpx.AsyncClient) -> None:
        """Cached prefixes hold keys and values of the old weights; they must not serve new requests."""
        for _ in range(5):
            try:
                response = await _post_retrying(client, "/reset_prefix_cache")
                if response.status_code == 200 and response.json().get("success"):
                    return
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("resetting vLLM's prefix cache: %s", exc)
            await asyncio.sleep(0.2)  # blocks still held by a request on its way out
        log.warning("vLLM did not reset its prefix cache after the reload; cached prefixes may be stale")

    async def _resume(self, client: httpx.AsyncClient) -> None:
        try:
            response = await _post_retrying(client, "/resume")
        except httpx.HTTPError as exc:
            raise PublishError(f"resuming vLLM failed, it stays paused: {exc}") from exc
        if response.status_code != 200:
            raise PublishError(f"resuming vLLM failed ({response.status_code}): {_vllm_message(response)}")


async def _post_retrying(client: httpx.AsyncClient, path: str, attempts: int = 3) -> httpx.Response:
    """POST an idempotent control call, again when the connection broke (resuming must not be lost)."""
    for attempt in range(attempts):
        try:
            return await client.post(path, timeout=60.0)
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError):
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.2)
    raise AssertionError("unreachable")
