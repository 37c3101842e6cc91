"""VLLMEngine against a real vLLM server (CPU) serving SmolLM2-135M-Instruct."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tracetrain.engines.base import EngineError, EngineTimeout, EngineUnavailable, SamplingParams, TokenDelta
from tracetrain.engines.vllm import VLLMEngine
from tracetrain.engines.vllm_server import async_http_client, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

EOS = 2  # <|im_end|>
GREEDY = SamplingParams(max_tokens=48, temperature=0.0)


@pytest.fixture(scope="session")
def tokenizer(smollm2_path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


def chat(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


@pytest.fixture(scope="session")
def paris_prompt(tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    return chat(tokenizer, "What is the capital of France?")


@pytest.fixture(scope="session")
def story_prompt(tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    return chat(tokenizer, "Write a short story about a robot who learns to paint.")


@pytest.fixture
async def engine(vllm_server) -> AsyncIterator[VLLMEngine]:  # type: ignore[no-untyped-def]
    engine = VLLMEngine(vllm_server.url, vllm_server.model_name, timeout=120)
    yield engine
    await engine.close()


async def run(engine: VLLMEngine, prompt: list[int], params: SamplingParams) -> list[TokenDelta]:
    return [delta async for delta in engine.generate(prompt, params)]


def merged(deltas: list[TokenDelta]) -> tuple[list[int], list[float], str, str | None]:
    assert deltas and deltas[-1].finish_reason is not None
    assert all(d.finish_reason is None for d in deltas[:-1])
    ids = [t for d in deltas for t in d.token_ids]
    logprobs = [lp for d in deltas for lp in d.logprobs]
    return ids, logprobs, "".join(d.text for d in deltas), deltas[-1].finish_reason


async def test_greedy_returns_ids_logprobs_and_clean_text(engine, paris_prompt, tokenizer):
    deltas = await run(engine, paris_prompt, GREEDY)
    ids, logprobs, text, finish = merged(deltas)
    assert all(len(d.token_ids) == len(d.logprobs) for d in deltas)
    assert len(ids) == len(logprobs) > 1
    assert all(isinstance(lp, float) and lp <= 0.0 and math.isfinite(lp) for lp in logprobs)
    assert "Paris" in text
    # The EOS the model sampled is recorded (with its logprob) but not shown to the client.
    assert finish == "stop" and ids[-1] == EOS and EOS not in ids[:-1]
    assert "<|im_end|>" not in text
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert all(d.top_logprobs is None for d in deltas)


async def test_stream_concatenates_to_the_non_streamed_result(engine, vllm_server, story_prompt, tokenizer):
    params = SamplingParams(max_tokens=40, temperature=0.0)
    deltas = await run(engine, story_prompt, params)
    ids, logprobs, text, finish = merged(deltas)
    assert len(deltas) > 5  # really streamed
    body = {"model": vllm_server.model_name, "prompt": story_prompt, "max_tokens": 40, "temperature": 0.0,
            "return_token_ids": True, "logprobs": 0}
    async with async_http_client(vllm_server.url, timeout=120) as client:
        reference = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    assert ids == reference["token_ids"]
    assert logprobs == pytest.approx(reference["logprobs"]["token_logprobs"], abs=1e-4)
    assert text == reference["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert finish == reference["finish_reason"] == "length"


async def test_max_tokens_is_respected(engine, story_prompt):
    params = SamplingParams(max_tokens=3, temperature=0)
    ids, logprobs, _, finish = merged(await run(engine, story_prompt, params))
    assert len(ids) == len(logprobs) == 3
    assert finish == "length"


async def test_stop_string_cuts_text_but_keeps_sampled_ids(engine, story_prompt, tokenizer):
    unstopped = SamplingParams(max_tokens=40, temperature=0)
    full_ids, _, full_text, _ = merged(await run(engine, story_prompt, unstopped))
    words = full_text.split()
    stop = " " + words[len(words) // 2]
    assert stop in full_text
    params = SamplingParams(max_tokens=40, temperature=0, stop=[stop])
    ids, logprobs, text, finish = merged(await run(engine, story_prompt, params))
    assert finish == "stop"
    assert text == full_text[: full_text.index(stop)]
    assert ids == full_ids[: len(ids)] and len(ids) == len(logprobs)
    # The ids run up to the token that completed the stop string, so they decode to text plus the stop.
    assert tokenizer.decode(ids, skip_special_tokens=True).startswith(text + stop)


async def test_top_logprobs_and_greedy_token_is_the_most_likely(engine, paris_prompt, tokenizer):
    deltas = await run(engine, paris_prompt, SamplingParams(max_tokens=12, temperature=0, top_logprobs=5))
    for delta in deltas:
        assert delta.top_logprobs is not None and len(delta.top_logprobs) == len(delta.token_ids)
        for token_id, logprob, top in zip(delta.token_ids, delta.logprobs, delta.top_logprobs, strict=True):
            assert 1 <= len(top) <= 5
            assert logprob == pytest.approx(max(top.values()), abs=1e-5)
            assert top[tokenizer.decode([token_id])] == pytest.approx(logprob, abs=1e-5)


async def test_seeded_sampling_is_reproducible(engine, story_prompt):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=7)
    first = merged(await run(engine, story_prompt, params))
    second = merged(await run(engine, story_prompt, params))
    assert first[0] == second[0] and first[2] == second[2]


async def test_concurrent_requests_share_the_client(engine, paris_prompt):
    results = await asyncio.gather(*(run(engine, paris_prompt, GREEDY) for _ in range(3)))
    assert len({tuple(merged(r)[0]) for r in results}) == 1


async def test_eos_never_in_text_even_with_special_tokens_kept(vllm_server, paris_prompt):
    """vLLM does not detokenize the EOS that stopped a request, whatever skip_special_tokens says;
    the flag only matters for special tokens in the middle of a generation."""
    engine = VLLMEngine(vllm_server.url, vllm_server.model_name, skip_special_tokens=False)
    try:
        ids, _, text, finish = merged(await run(engine, paris_prompt, GREEDY))
    finally:
        await engine.close()
    assert finish == "stop" and ids[-1] == EOS and "<|im_end|>" not in text


async def test_prompt_longer_than_max_model_len_is_a_400(engine, vllm_server):
    with pytest.raises(EngineError) as info:
        await run(engine, [198] * (vllm_server.max_model_len + 10), GREEDY)
    assert info.value.status == 400
    assert "maximum context length" in str(info.value)


async def test_health(engine):
    assert await engine.health()
    dead = VLLMEngine(f"http://127.0.0.1:{free_port()}", "x")
    assert not await dead.health()
    await dead.close()


async def test_nothing_listening_is_unavailable(paris_prompt):
    engine = VLLMEngine(f"http://127.0.0.1:{free_port()}", "x")
    with pytest.raises(EngineUnavailable) as info:
        await run(engine, paris_prompt, GREEDY)
    assert info.value.status == 503
    await engine.close()


async def test_tiny_timeout_is_engine_timeout(vllm_server, story_prompt):
    engine = VLLMEngine(vllm_server.url, vllm_server.model_name, timeout=0.001)
    with pytest.raises(EngineTimeout) as info:
        await run(engine, story_prompt, SamplingParams(max_tokens=8, temperature=0))
    assert info.value.status == 504
    await engine.close()
