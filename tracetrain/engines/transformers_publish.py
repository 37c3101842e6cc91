"""Publishing to the in-process transformers engine: weights swapped between two requests."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tracetrain.config import DEFAULT_POLICY
from tracetrain.engines.publishing import Checkpoint, PublishError, check_known, check_lora_checkpoint, model_shapes

if TYPE_CHECKING:
    import torch

    from tracetrain.engines.transformers_engine import TransformersEngine

log = logging.getLogger(__name__)


class InProcessPublisher:
    """Publishes to the in-process `TransformersEngine`: loads the checkpoint as a state dict off the
    event loop, then `swap_weights` applies it between two requests, so requests in flight finish on the
    old version and no request fails.

    LoRA adapters are deltas on the base model, so they are merged into a fresh copy of the base
    weights (`base_model_dir`, by default the directory the engine was loaded from), never into
    whatever version is being served.
    """

    def __init__(self, engine: TransformersEngine, *, base_model_dir: str | Path | None = None) -> None:
        self.engine = engine
        base = base_model_dir or engine.model.name_or_path
        if not base:
            raise ValueError("the engine's model has no directory: pass base_model_dir")
        self.base_model_dir = Path(base)
        self._lock = asyncio.Lock()

    async def publish(self, checkpoint: Checkpoint) -> None:
        await self._hand_over(checkpoint, self.engine.swap_weights, "serving")

    async def publish_line(self, checkpoint: Checkpoint) -> None:
        """A named policy's version: its adapter merged into the base weights, served to that policy's requests."""
        async def apply(state_dict: dict[str, torch.Tensor], version: int) -> None:
            await self.engine.hold_line(checkpoint.line, state_dict, version)

        await self._hand_over(checkpoint, apply, f"serving policy {checkpoint.line!r}")

    # --- canary promotion -------------------------------------------------------------------------

    async def stage(self, checkpoint: Checkpoint) -> None:
        """Hold a version next to the served one (of its line), for the sessions assigned to it."""
        if checkpoint.line != DEFAULT_POLICY:
            async def apply(state_dict: dict[str, torch.Tensor], version: int) -> None:
                await self.engine.stage_line(checkpoint.line, state_dict, version)

            await self._hand_over(checkpoint, apply, f"holding as policy {checkpoint.line!r}'s canary")
            return
        await self._hand_over(checkpoint, self.engine.stage_weights, "holding as a canary")

    async def _hand_over(self, checkpoint: Checkpoint, apply: Callable[[dict[str, torch.Tensor], int], Awaitable[None]],
                         what: str) -> None:
        """Load the checkpoint off the event loop, then let the engine take it on its worker thread."""
        async with self._lock:
            state_dict = await asyncio.to_thread(self.load_state_dict, checkpoint)
            try:
                await apply(state_dict, checkpoint.version)
            except (ValueError, RuntimeError) as exc:
                raise PublishError(f"{what} version {checkpoint.version} failed: {exc}") from exc
        log.info("%s version %d (%s) from %s", what, checkpoint.version, checkpoint.kind, checkpoint.path)

    async def promote(self, checkpoint: Checkpoint) -> None:
        if checkpoint.line != DEFAULT_POLICY:
            if self.engine.holds_line(checkpoint.line, checkpoint.version):
                await self.engine.serve_line_version(checkpoint.line, checkpoint.version)
            else:
                await self.publish_line(checkpoint)
            return
        if self.engine.holds(checkpoint.version):
            await self.engine.serve_version(checkpoint.version)
        else:
            await self.publish(checkpoint)

    async def retire(self, version: int, line: str = DEFAULT_POLICY) -> None:
        if line != DEFAULT_POLICY:
            self.engine.drop_line_version(line, version)
        else:
            self.engine.drop_version(version)

    def load_state_dict(self, checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
        """The full state dict the engine should serve for `checkpoint` (runs in a worker thread)."""
        try:
            if checkpoint.kind == "full":
                return self._load_full(checkpoint.path)
            return self._merge_lora(checkpoint.path)
        except PublishError:
            raise
        except Exception as exc:  # torch, safetensors and peft raise many kinds
            raise PublishError(f"loading version {checkpoint.version} from {checkpoint.path}: "
                               f"{type(exc).__name__}: {exc}") from exc

    def _load_full(self, path: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        reference = {k: tuple(v.shape) for k, v in self.engine.model.state_dict().items()}
        shapes = model_shapes(path) if path.is_dir() else {}
        if not shapes:
            raise PublishError(f"checkpoint directory {path} does not exist")
        check_known(shapes, reference, path)
        state: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            state.update(load_file(str(file)))
        return state

    def _merge_lora(self, path: Path) -> dict[str, torch.Tensor]:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        check_lora_checkpoint(path)
        dtype = next(self.engine.model.parameters()).dtype
        base = AutoModelForCausalLM.from_pretrained(str(self.base_model_dir), dtype=dtype)
        merged = PeftModel.from_pretrained(base, str(path)).merge_and_unload()
        return {k: v.detach() for k, v in merged.state_dict().items()}
