"""An in-process engine on Hugging Face transformers, for tests and machines without vLLM.

One model, one worker thread: every request's decode loop and every weight swap run in a single-thread
executor, so requests are served one after another in arrival order (FIFO) while the event loop stays
free. That is the right trade on a 2-core CPU box; use vLLM for throughput.

Logprobs follow vLLM's default (`logprobs_mode="raw_logprobs"`): `log_softmax` of the raw model
logits, before temperature and top-p. That is the distribution the trainer recomputes, so stored
logprobs compare directly with its own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .base import Affinity, EngineError, EngineUnavailable, SamplingParams, TokenDelta

_Item = TokenDelta | BaseException


class IncrementalText:
    """Detokenizes a growing list of ids; `push` returns only new, stable text (never half a
    UTF-8 character). Special tokens are left out of the text."""

    def __init__(self, tokenizer) -> None:  # type: ignore[no-untyped-def]
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # the stable text so far

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self._tokenizer.decode(self.ids, skip_special_tokens=True)
        stable = full.rstrip("\ufffd")  # an incomplete byte sequence decodes to U+FFFD for now
        if not stable.startswith(self.text):  # the tokenizer revised earlier text: never un-send it
            return ""
        new, self.text = stable[len(self.text) :], stable
        return new

    def flush(self) -> str:
        """At the end of the stream, whatever is left (including genuinely invalid bytes)."""
        full = self._tokenizer.decode(self.ids, skip_special_tokens=True)
        new = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += new
        return new


class TransformersEngine:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        model_name: str | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        threads: int | None = None,
    ) -> None:
        self.model_name = model_name or Path(model_dir).name
        self.version = 0
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        self.model.to(self.device).eval()  # type: ignore[arg-type]  # transformers' decorator confuses mypy
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.max_len: int = getattr(self.model.config, "max_position_embeddings", None) or 1 << 30
        # torch's intra-op threads for the worker; with torch's OpenMP backend the setting is local to
        # that thread. On a small, busy CPU box, 1 avoids spin-waiting threads fighting for cores.
        init = (lambda: torch.set_num_threads(threads)) if threads else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tracetrain-engine", initializer=init)
        self._loaded = 0
        """The version whose weights are in `model` now (the served one, or a canary a request asked for)."""
        self._held: dict[int, dict[str, torch.Tensor]] = {}
        """Full weights of versions held for canary promotion, by version."""
        self._lines: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
        """Named policies' newest versions, full weights each (their adapter merged into the base model)."""
        self._line_canaries: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        """Named policies' staged versions (canary promotion), full weights each, by (policy, version)."""
        self._line_loaded: tuple[str, int] | None = None
        """The named line (and version) whose weights are in `model` now; None: the default line's."""
        self._base: dict[str, torch.Tensor] | None = None
        """The base model's weights, for named lines with no version yet (read from disk when first needed)."""
        self._dtype = dtype
        self._closed = False

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       affinity: Affinity | None = None) -> AsyncIterator[TokenDelta]:
        del affinity  # one engine: nothing to route
        if self._closed:
            raise EngineUnavailable("engine is closed")
        if params.structured_output is not None:
            raise EngineError("tool_choice 'required'/named and response_format need constrained decoding, "
                              "which the in-process transformers engine does not do; use the vllm engine",
                              status=400, code="unsupported_parameter")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        cancel = threading.Event()

        def emit(item: _Item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone: nobody is listening
                cancel.set()

        try:
            loop.run_in_executor(self._executor, self._run, list(prompt_ids), params, emit, cancel)
        except RuntimeError as exc:  # closed meanwhile
            raise EngineUnavailable("engine is closed") from exc
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            cancel.set()  # the client went away or the stream ended: stop decoding at the next step

    async def swap_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights (all or some parameters) in the worker thread, between two requests, so
        every generation comes from exactly one version."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self._swap, state_dict, version)

    async def close(self) -> None:
        self._closed = True  # queued requests fail fast, a running one stops at its next step
        await asyncio.to_thread(self._executor.shutdown, True)

    # --- worker thread ---------------------------------------------------------------------------

    def _swap(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._back_to_default()
        if self._loaded != self.version:  # a canary's weights are in the model: start from the served ones
            self._load(self._held[self.version])
        self._load(state_dict)
        self.version = self._loaded = version
        self._held.clear()

    def _load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        current = self.model.state_dict()
        bad = [k for k, v in state_dict.items() if k not in current or current[k].shape != v.shape]
        if bad:  # checked first, so a rejected swap leaves the served weights untouched
            raise ValueError(f"unknown parameters or wrong shapes: {bad[:5]}")
        with torch.no_grad():
            self.model.load_state_dict(dict(state_dict), strict=False)

    # --- canary promotion: a second version held next to the served one -----------------------------

    async def stage_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Hold `version` for requests that ask for it (`SamplingParams.version`); the model switches
        between versions per request on the worker thread (a full copy each: fine for the small models
        this engine is for, not for serving at scale)."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self._stage, state_dict, version)

    def holds(self, version: int) -> bool:
        return version in self._held

    def drop_version(self, version: int) -> None:
        self._held.pop(version, None)

    async def serve_version(self, version: int) -> None:
        """Make a held version the one every request gets."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self._serve, version)

    def _stage(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._back_to_default()
        current = self.model.state_dict()
        bad = [k for k, v in state_dict.items() if k not in current or current[k].shape != v.shape]
        if bad:
            raise ValueError(f"unknown parameters or wrong shapes: {bad[:5]}")
        if self._loaded not in self._held:  # the weights loaded now, to switch back to
            self._held[self._loaded] = {k: v.detach().clone() for k, v in current.items()}
        self._held[version] = {**self._held[self._loaded], **state_dict}

    def _serve(self, version: int) -> None:
        self._back_to_default()
        if version != self._loaded:
            self._load(self._held[version])
        previous, self.version, self._loaded = self.version, version, version
        # Sessions that started on the previous version keep it; older ones are let go.
        self._held = {v: w for v, w in self._held.items() if v in (version, previous)}

    # --- named policies: each line's newest version, switched per request --------------------------

    async def hold_line(self, line: str, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Serve `version` of named policy `line` to the requests for that line (`SamplingParams.line`); the
        model switches between lines per request on the worker thread (a full copy of the weights each, as
        for a canary: fine for the small models this engine is for)."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self._hold_line, line, state_dict, version)

    async def stage_line(self, line: str, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Hold `version` of named policy `line` for that line's requests that ask for it by version."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self._hold_line, line, state_dict, version,
                                                         True)

    def holds_line(self, line: str, version: int) -> bool:
        return (line, version) in self._line_canaries

    def drop_line_version(self, line: str, version: int) -> None:
        self._line_canaries.pop((line, version), None)

    async def serve_line_version(self, line: str, version: int) -> None:
        """Make a staged version of `line` the one every request of that line gets."""
        def serve() -> None:
            self._lines[line] = (version, self._line_canaries.pop((line, version)))
        await asyncio.get_running_loop().run_in_executor(self._executor, serve)

    def line_versions(self) -> dict[str, int]:
        return {line: version for line, (version, _) in self._lines.items()}

    def _hold_line(self, line: str, state_dict: Mapping[str, torch.Tensor], version: int, staged: bool = False) -> None:
        current = self.model.state_dict()
        bad = [k for k, v in state_dict.items() if k not in current or current[k].shape != v.shape]
        if bad:
            raise ValueError(f"unknown parameters or wrong shapes: {bad[:5]}")
        weights = {**self._base_weights(), **state_dict}
        if staged:
            self._line_canaries[(line, version)] = weights
        else:
            self._lines[line] = (version, weights)

    def _base_weights(self) -> dict[str, torch.Tensor]:
        if self._base is None:
            base = AutoModelForCausalLM.from_pretrained(str(self.model.name_or_path), dtype=self._dtype)
            self._base = {k: v.detach().to(self.device) for k, v in base.state_dict().items()}
        return self._base

    def _back_to_default(self) -> None:
        """Put the default line's weights back in the model if a named line's are in it (worker thread)."""
        if self._line_loaded is not None:
            self._load(self._held[self._loaded])
            self._line_loaded = None

    def _use_line(self, line: str, asked: int | None) -> int:
        if asked is not None and (line, asked) in self._line_canaries:
            version, weights = asked, self._line_canaries[(line, asked)]
        else:
            version, weights = self._lines.get(line) or (0, self._base_weights())
        if self._line_loaded != (line, version):
            if self._line_loaded is None and self._loaded not in self._held:  # to come back to
                self._held[self._loaded] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self._load(weights)
            self._line_loaded = (line, version)
        return version

    def _use(self, version: int | None, line: str | None = None) -> int:
        """The version this request runs on, loaded (worker thread)."""
        if line is not None:
            return self._use_line(line, version)
        self._back_to_default()
        wanted = version if version is not None and version in self._held else self.version
        if wanted != self._loaded:
            self._load(self._held[wanted])
            self._loaded = wanted
        return wanted

    def _run(
        self,
        prompt: list[int],
        params: SamplingParams,
        emit: Callable[[_Item], None],
        cancel: threading.Event,
    ) -> None:
        try:
            self._decode(prompt, params, emit, cancel)
        except Exception as exc:  # every failure must reach the waiting client
            emit(exc if isinstance(exc, EngineError) else EngineError(f"generation failed: {exc!r}"))

    @torch.inference_mode()
    def _decode(
        self,
        prompt: list[int],
        params: SamplingParams,
        emit: Callable[[_Item], None],
        cancel: threading.Event,
    ) -> None:
        vocab = self.model.config.vocab_size
        if not prompt or min(prompt) < 0 or max(prompt) >= vocab:
            raise EngineError(
                "prompt must be non-empty token ids below the vocabulary size",
                status=400,
                code="invalid_prompt",
            )
        if len(prompt) >= self.max_len:
            raise EngineError(
                f"prompt of {len(prompt)} tokens exceeds the context of {self.max_len}",
                status=400,
                code="context_length_exceeded",
            )
        max_tokens = min(params.max_tokens, self.max_len - len(prompt))
        generator = torch.Generator(device=self.device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        stops = [s for s in params.stop if s]
        hold = max((len(s) for s in stops), default=1) - 1  # chars that might start a stop string
        detok = IncrementalText(self.tokenizer)
        sent = 0  # chars of detok.text already emitted
        # swaps run on this same worker thread, so not during this loop
        version = self._use(params.version, params.line)

        input_ids = torch.tensor([prompt], device=self.device)
        out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        finish: str | None = "length" if max_tokens <= 0 else None
        step = 0
        while finish is None:
            if cancel.is_set() or self._closed:
                raise EngineUnavailable("engine is closed") if self._closed else EngineError("cancelled")
            logits = out.logits[0, -1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            token = self._sample(logits, params, generator)
            detok.push(token)
            step += 1
            text = detok.text
            if token in self.eos_ids:
                finish = "stop"
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                finish, text = "stop", text[:cut]
            elif finish is None and step >= max_tokens:
                finish = "length"
            if finish is not None and cut < 0:
                text += detok.flush()
            end = len(text) if finish is not None else max(sent, len(text) - hold)
            top = [self._top(logprobs, params.top_logprobs)] if params.top_logprobs > 0 else None
            emit(TokenDelta([token], [float(logprobs[token])], text[sent:end], top, finish, version))
            sent = end
            if finish is None:
                next_ids = torch.tensor([[token]], device=self.device)
                out = self.model(input_ids=next_ids, past_key_values=out.past_key_values, use_cache=True)
        if step == 0:
            emit(TokenDelta([], [], "", [] if params.top_logprobs > 0 else None, finish, version))

    def _top(self, logprobs: torch.Tensor, k: int) -> dict[str, float]:
        values, ids = torch.topk(logprobs, k)
        top: dict[str, float] = {}
        for value, token_id in zip(values.tolist(), ids.tolist(), strict=True):
            top.setdefault(str(self.tokenizer.decode([token_id])), value)  # tokens with the same text: best
        return top

    @staticmethod
    def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
        if params.temperature <= 1e-5:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > params.top_p
            sorted_probs[outside] = 0.0  # the most likely token always stays
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=generator))
