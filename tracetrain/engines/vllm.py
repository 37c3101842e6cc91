"""An engine that talks to a vLLM OpenAI server over HTTP.

The gateway renders prompts itself, so this engine uses vLLM's `/v1/completions` with `prompt` as a
list of token ids: vLLM then neither re-tokenizes nor adds a BOS, and the ids the store records are
exactly the ids the model saw. A streamed client request streams from vLLM; a non-streamed one gets
vLLM's one-piece answer (same fields, no per-token events to parse). Always with
`return_token_ids: true` and `logprobs: k`. What vLLM 0.32 sends back, per SSE chunk (or in the one
body), in `choices[0]`:

- `token_ids`: the ids sampled since the previous chunk (the first chunk also has
  `prompt_token_ids`, our prompt echoed back, which we check);
- `logprobs.token_logprobs`: one float per id, the sampled token's raw logprob (`logprobs: 0` is
  enough for it); `logprobs.top_logprobs`: per id, a dict token text -> logprob holding the sampled
  token plus the top k (so k + 1 entries when the sampled token is not among the top k);
- `text`: the detokenized delta. It can lag the ids (text that might begin a stop string is held
  back) and omits stop strings, so text and ids are aligned only as wholes;
- `finish_reason` on the last chunk, which also carries that chunk's ids. An EOS (`<|im_end|>` for
  SmolLM2) is in `token_ids` with its logprob but not in `text` (`skip_special_tokens`); a stop
  string's tokens are in `token_ids` too, since the model sampled them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import orjson
from yarl import URL

from .base import Affinity, EngineError, EngineTimeout, EngineUnavailable, SamplingParams, TokenDelta
from .vllm_server import engine_address

KEEPALIVE_S = 4.0
"""How long an idle pooled connection is kept: less than vLLM's own keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
5 s by default), so the client never writes on a connection the server is closing."""


class VLLMEngine:
    """Generates through one vLLM server; one pooled aiohttp session for all requests.

    aiohttp rather than httpx for this one client: on the gateway's hot path httpx's per-request URL
    handling and pool bookkeeping were a large share of the gateway's CPU per call (profiled, see
    docs/benchmarks.md); the other, occasional HTTP calls keep httpx."""

    def __init__(
        self,
        base_url: str,
        model_name: str,
        *,
        timeout: float = 600.0,
        skip_special_tokens: bool = True,
        max_connections: int = 256,
        json_max_whitespace: int | None = 64,
    ) -> None:
        """`base_url` is the server root (`http://host:port`, a trailing `/v1` is accepted), or
        `unix:/path/to/socket` for a server listening on a Unix socket (what `VLLMServer` starts).
        `timeout` bounds each network wait (connect, and the gap between streamed chunks, which
        includes prefill), not a whole generation. `skip_special_tokens=False` is for models whose
        tool-call markers are special tokens; SmolLM2's `<tool_call>` is plain text either way.
        `json_max_whitespace`: see `json_constraint`; None sends JSON constraints as they are, under
        the server's own whitespace setting."""
        self.address = engine_address(base_url)
        self.base_url = self.address.url
        """The server as shown in logs and replica state (the socket path for a socket)."""
        self.model_name = model_name
        self.version = 0
        self.served_model = model_name
        """What requests name as `model`: the base model, or the LoRA adapter of the current version."""
        self.adapters: dict[int, str | None] = {}
        """Other versions this server holds, by version: the adapter to name (None: the base model). A
        request that asks for one of them (`SamplingParams.version`, canary promotion) gets it."""
        self.lines: dict[str, tuple[int, str]] = {}
        """Named policies' newest versions, (version, LoRA adapter name) by policy (docs/architecture.md,
        decision 13). A policy not here is served the base model, its version 0."""
        self.line_canaries: dict[tuple[str, int], str] = {}
        """Named policies' staged versions (canary promotion), the adapter by (policy, version): a request of
        that policy asking for that version gets it."""
        self.skip_special_tokens = skip_special_tokens
        self.json_max_whitespace = json_max_whitespace
        self._timeout = aiohttp.ClientTimeout(total=None, connect=min(timeout, 10.0), sock_read=timeout)
        self._max_connections = max_connections
        self._completions = URL(f"{self.address.http_base}/v1/completions")  # parsed once, not per request
        self._health = URL(f"{self.address.http_base}/health")
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        """The pooled session, made on first use: aiohttp binds it to the running event loop."""
        if self._session is None or self._session.closed:
            uds = self.address.uds
            # A pooled connection is dropped before the server would close it (vLLM's default keep-alive,
            # VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a request written on one the server closed meanwhile fails with
            # a broken pipe instead of being sent.
            limit = self._max_connections
            connector: aiohttp.BaseConnector = (
                aiohttp.UnixConnector(path=uds, limit=limit, keepalive_timeout=KEEPALIVE_S) if uds is not None
                else aiohttp.TCPConnector(limit=limit, keepalive_timeout=KEEPALIVE_S))
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                connector=connector,
                # The first stream line echoes the prompt's ids: up to several MB for long prompts.
                read_bufsize=4 * 1024 * 1024,
                headers={"Content-Type": "application/json"},
            )
        return self._session

    def use_adapter(self, adapter: str | None, version: int) -> None:
        """Serve `adapter` (a LoRA name loaded into vLLM; None for the base model) as `version`.

        Both change in one step with no await in between, so `version` always names the weights that
        a request sent from now on gets. Requests already sent keep the adapter they named: vLLM binds
        a request to its adapter on arrival."""
        self.served_model = adapter or self.model_name
        self.version = version
        if adapter is None:  # new full weights (or a fresh server): no other version is held any more
            self.adapters = {version: None}
        else:
            self.adapters[version] = adapter

    def reset(self) -> None:
        """A fresh server: the base weights as version 0, no adapter of any line."""
        self.use_adapter(None, 0)
        self.lines, self.line_canaries = {}, {}

    def use_line(self, line: str, adapter: str, version: int) -> None:
        """Serve `adapter` as named policy `line`'s `version` from the next request of that policy on."""
        self.lines[line] = (version, adapter)

    def line_versions(self) -> dict[str, int]:
        return {line: version for line, (version, _) in self.lines.items()}

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       affinity: Affinity | None = None) -> AsyncIterator[TokenDelta]:
        del affinity  # one engine: nothing to route
        # The version is read together with the adapter named in `body`, with no await between: exact.
        staged = (params.line, params.version) if params.line is not None and params.version is not None else None
        if staged is not None and staged in self.line_canaries:
            model, version = self.line_canaries[staged], staged[1]
        elif params.line is not None:
            version, model = self.lines.get(params.line, (0, self.model_name))
        elif params.version is not None and params.version in self.adapters:
            model, version = self.adapters[params.version] or self.model_name, params.version
        else:
            model, version = self.served_model, self.version
        body = self._request_body(prompt_ids, params, model)
        if not params.stream:
            yield await self._complete(body, prompt_ids, params, version)
            return
        final: TokenDelta | None = None
        with _engine_errors(self.base_url):
            async with self._http().post(self._completions, data=orjson.dumps(body)) as response:
                if response.status != 200:
                    raise _http_error(response.status, (await response.read()).decode(errors="replace"))
                async for chunks in _sse_batches(response):
                    arrived: list[TokenDelta] = []
                    for chunk in chunks:
                        delta = self._parse_chunk(chunk, prompt_ids, params)
                        if delta is None:
                            continue
                        delta.version = version
                        if delta.finish_reason is not None:
                            final = delta  # read on to [DONE] first, so the connection goes back to the pool
                        elif delta.token_ids or delta.text:
                            arrived.append(delta)
                    if arrived:
                        yield arrived[0] if len(arrived) == 1 else _joined(arrived)
        if final is None:
            raise EngineError("vLLM ended the stream without a finish_reason")
        yield final

    async def _complete(self, body: dict[str, Any], prompt_ids: list[int], params: SamplingParams,
                        version: int) -> TokenDelta:
        """One non-streamed completion: a third of the gateway's CPU per call was parsing SSE events."""
        with _engine_errors(self.base_url):
            async with self._http().post(self._completions, data=orjson.dumps({**body, "stream": False})) as response:
                content = await response.read()
                status = response.status
        if status != 200:
            raise _http_error(status, content.decode(errors="replace"))
        try:
            payload = orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise EngineError(f"vLLM sent an unreadable body: {content[:200]!r}") from exc
        delta = self._parse_chunk(payload, prompt_ids, params)
        if delta is None or delta.finish_reason is None:
            raise EngineError("vLLM answered without a finished choice")
        delta.version = version
        return delta

    async def health(self) -> bool:
        """True when the server answers `/health` with 200; never raises."""
        try:
            async with self._http().get(self._health, timeout=aiohttp.ClientTimeout(total=5.0)) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _request_body(self, prompt_ids: list[int], params: SamplingParams, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt_ids,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream": True,
            "return_token_ids": True,
            "logprobs": params.top_logprobs,  # 0 still returns the sampled token's logprob
            "skip_special_tokens": self.skip_special_tokens,
        }
        if params.stop:
            body["stop"] = params.stop
        if params.seed is not None:
            body["seed"] = params.seed
        if params.structured_output is not None:
            body["structured_outputs"] = json_constraint(params.structured_output, self.json_max_whitespace)
        return body

    def _parse_chunk(
        self, chunk: dict[str, Any], prompt_ids: list[int], params: SamplingParams
    ) -> TokenDelta | None:
        if "error" in chunk:
            # An error after vLLM accepted the request arrives as a data line, labelled 400 even for
            # server-side failures; the request itself was valid, so it is the engine's failure.
            raise EngineError(f"vLLM failed mid-stream: {chunk['error'].get('message', chunk)}")
        if not chunk.get("choices"):
            return None  # a usage-only chunk
        choice = chunk["choices"][0]
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and echoed != prompt_ids:
            raise EngineError("vLLM generated from different prompt ids than the ones sent")
        token_ids: list[int] = choice.get("token_ids") or []
        logprobs = choice.get("logprobs") or {}
        token_logprobs = logprobs.get("token_logprobs") or []
        if len(token_logprobs) != len(token_ids) or any(lp is None for lp in token_logprobs):
            raise EngineError(f"vLLM returned {len(token_ids)} token ids but logprobs {token_logprobs!r}")
        top: list[dict[str, float]] | None = None
        if params.top_logprobs > 0:
            # vLLM adds the sampled token to the top k; keep the k most likely, as OpenAI clients expect.
            top = [
                dict(sorted((d or {}).items(), key=lambda kv: kv[1], reverse=True)[: params.top_logprobs])
                for d in logprobs.get("top_logprobs") or []
            ]
        return TokenDelta(
            token_ids=token_ids,
            logprobs=[float(lp) for lp in token_logprobs],
            text=choice.get("text") or "",
            top_logprobs=top,
            finish_reason=choice.get("finish_reason"),
        )


def json_constraint(constraint: dict[str, Any], max_whitespace: int | None) -> dict[str, Any]:
    """A JSON constraint (`{"json": schema}` / `{"json_object": true}`) as an xgrammar structural tag
    whose JSON may hold at most `max_whitespace` consecutive whitespace characters.

    Why: under a JSON grammar with free whitespace a small model can pad with newlines until
    `max_tokens` (seen with SmolLM2 on forced tool calls), and with no whitespace at all it can loop
    inside a string instead (seen on a two-field schema where vLLM's default stops after 40 tokens).
    vLLM 0.32 sets whitespace per server only, but xgrammar's structural tags take a per-request
    bound (`max_whitespace_cnt`), which keeps the layout the model prefers (`{\n  "key": …`, nested
    levels indented) and still ends every whitespace run (`bench/results/constrained_json.md`, in git
    history at af20f58). Other constraints, and every constraint when `max_whitespace` is None, go to vLLM unchanged."""
    if max_whitespace is None or not ({"json", "json_object"} & constraint.keys()):
        return constraint
    schema = constraint.get("json") or {"type": "object"}
    if isinstance(schema, str):
        schema = json.loads(schema)
    tag = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema,
                                                "max_whitespace_cnt": max_whitespace}}
    return {"structural_tag": orjson.dumps(tag).decode()}


@contextlib.contextmanager
def _engine_errors(base_url: str) -> Iterator[None]:
    """Network failures as engine errors with the status the gateway answers: 503, 504 or 502."""
    try:
        yield
    except aiohttp.ClientConnectorError as exc:
        raise EngineUnavailable(f"vLLM at {base_url} is not reachable: {exc}") from exc
    except TimeoutError as exc:  # connect or read timeout (aiohttp's are TimeoutErrors)
        raise EngineTimeout(f"vLLM at {base_url} timed out ({type(exc).__name__})") from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as exc:
        # The connection broke: the server died or restarted.
        raise EngineError(f"vLLM at {base_url} dropped the connection: {type(exc).__name__}: {exc}",
                          code="engine_connection_lost") from exc
    except aiohttp.ClientError as exc:
        raise EngineError(f"vLLM at {base_url} failed: {type(exc).__name__}: {exc}") from exc


async def _sse_batches(response: aiohttp.ClientResponse) -> AsyncIterator[list[dict[str, Any]]]:
    """The JSON payloads of an OpenAI-style server-sent event stream up to `data: [DONE]`, as batches: all
    the events that have arrived when the reader gets to them. Under load many tokens arrive between two
    reads, and one pass over a batch (and one delta for it) cost far less than a read, a parse and a
    delta per token (profiled); at low load a batch is one event.

    Bytes after [DONE] (there are none, but the body must end) are still read: a response left unread
    closes its connection instead of returning it to the pool, a TCP handshake per call.
    """
    done = False
    rest = b""
    while True:
        data = await response.content.readany()
        if not data:
            break
        lines = (rest + data).split(b"\n")
        rest = lines.pop()  # an incomplete last line waits for the next read
        if done:
            continue
        batch: list[dict[str, Any]] = []
        for raw in lines:
            if not raw.startswith(b"data:"):
                continue
            payload = raw[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            try:
                batch.append(orjson.loads(payload))
            except orjson.JSONDecodeError as exc:
                raise EngineError(f"vLLM sent an unreadable stream line: {payload[:200]!r}") from exc
        if batch:
            yield batch


def _joined(deltas: list[TokenDelta]) -> TokenDelta:
    """Consecutive unfinished deltas as one."""
    tops = [d.top_logprobs for d in deltas]
    return TokenDelta([t for d in deltas for t in d.token_ids], [lp for d in deltas for lp in d.logprobs],
                      "".join(d.text for d in deltas),
                      None if all(t is None for t in tops) else [x for t in tops for x in t or []],
                      version=deltas[0].version)


def _http_error(status: int, body: str) -> EngineError:
    """vLLM's own message, with 400 when vLLM judged the request invalid (e.g. prompt too long)."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:1000]
    client_error = status in (400, 413, 422)
    return EngineError(
        f"vLLM answered {status}: {message}",
        status=400 if client_error else 502,
        code="invalid_request" if client_error else "engine_error",
    )
