from __future__ import annotations

import asyncio

import pytest

from tests.support.setup_steps import TORCH_MISSING

torch = pytest.importorskip("torch", reason=TORCH_MISSING)

from tracetrain.engines.base import EngineError, EngineUnavailable, SamplingParams, TokenDelta  # noqa: E402
from tracetrain.engines.transformers_engine import IncrementalText, TransformersEngine  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def sharpen(engine: TransformersEngine) -> TransformersEngine:
    """The tiny model's init (std 0.02, tied embeddings) greedily repeats the last prompt token;
    larger random weights give varied text, so greedy and stop-string checks mean something."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in engine.model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return engine


@pytest.fixture(scope="module")
def engine(tiny_model_path) -> TransformersEngine:
    return sharpen(TransformersEngine(tiny_model_path, model_name="tiny", threads=1))


@pytest.fixture(scope="module")
def prompt(engine: TransformersEngine) -> list[int]:
    messages = [{"role": "user", "content": "Say something nice about tokens."}]
    return engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


async def collect(engine: TransformersEngine, prompt: list[int], params: SamplingParams) -> list[TokenDelta]:
    return [delta async for delta in engine.generate(prompt, params)]


def merged(deltas: list[TokenDelta]) -> tuple[list[int], list[float], str, str | None]:
    ids = [t for d in deltas for t in d.token_ids]
    logprobs = [lp for d in deltas for lp in d.logprobs]
    return ids, logprobs, "".join(d.text for d in deltas), deltas[-1].finish_reason


async def test_greedy_matches_hf_generate_and_is_deterministic(engine, prompt):
    first = merged(await collect(engine, prompt, GREEDY))
    second = merged(await collect(engine, prompt, GREEDY))
    assert first[0] == second[0] and first[2] == second[2]
    with torch.no_grad():
        reference = engine.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)
    assert first[0] == reference[0, len(prompt) :].tolist()
    assert first[3] == ("stop" if first[0][-1] in engine.eos_ids else "length")


async def test_logprobs_equal_full_forward_log_softmax(engine, prompt):
    params = SamplingParams(max_tokens=10, temperature=1.3, top_p=0.9, seed=1)
    ids, logprobs, _, _ = merged(await collect(engine, prompt, params))
    assert len(ids) == len(logprobs) == 10
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + ids])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # raw, before temperature
    expected = expected.gather(1, torch.tensor(ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)


async def test_max_tokens_gives_length(engine, prompt):
    deltas = await collect(engine, prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=0))
    assert [len(d.token_ids) for d in deltas] == [1, 1, 1]
    assert [d.finish_reason for d in deltas] == [None, None, "length"]


async def test_stop_on_eos_includes_the_eos_token(engine, prompt):
    eos = next(iter(engine.eos_ids))
    bias = torch.zeros(engine.model.config.vocab_size)
    bias[eos] = 100.0  # make EOS the greedy choice after the first token
    original = engine.model.lm_head.forward
    steps = []

    def biased(hidden):
        steps.append(1)
        return original(hidden) + (bias if len(steps) > 1 else 0)

    engine.model.lm_head.forward = biased
    try:
        ids, logprobs, text, finish = merged(await collect(engine, prompt, GREEDY))
    finally:
        del engine.model.lm_head.forward
    assert finish == "stop" and len(ids) == 2 and ids[-1] == eos and len(logprobs) == 2
    assert text == engine.tokenizer.decode(ids[:1], skip_special_tokens=True)


async def test_stop_string_truncates_text_but_keeps_ids(engine, prompt):
    params = SamplingParams(max_tokens=20, temperature=0)
    full_ids, _, full_text, _ = merged(await collect(engine, prompt, params))
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 2]
    cut = full_text.find(stop)
    deltas = await collect(engine, prompt, SamplingParams(max_tokens=20, temperature=0, stop=["\x00", stop]))
    ids, _, text, finish = merged(deltas)
    assert finish == "stop" and text == full_text[:cut]
    assert ids == full_ids[: len(ids)] and len(ids) < len(full_ids)
    assert engine.tokenizer.decode(ids, skip_special_tokens=True).find(stop) == cut  # last id completed it
    assert stop not in engine.tokenizer.decode(ids[:-1], skip_special_tokens=True)


async def test_seed_makes_sampling_reproducible(engine, prompt):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1234)
    a = merged(await collect(engine, prompt, params))
    b = merged(await collect(engine, prompt, params))
    c = merged(await collect(engine, prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=99)))
    assert a == b
    assert a[0] != c[0]


async def test_tiny_top_p_is_greedy(engine, prompt):
    greedy = merged(await collect(engine, prompt, GREEDY))[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-9)
    nucleus = merged(await collect(engine, prompt, params))[0]
    assert nucleus == greedy


async def test_top_logprobs(engine, prompt):
    deltas = await collect(engine, prompt, SamplingParams(max_tokens=4, temperature=0, top_logprobs=3))
    for delta in deltas:
        assert delta.top_logprobs is not None and len(delta.top_logprobs) == len(delta.token_ids) == 1
        top = delta.top_logprobs[0]
        assert 1 <= len(top) <= 3 and all(v <= 0 for v in top.values())
        best = engine.tokenizer.decode(delta.token_ids)  # greedy: the sampled token is the best one
        assert top[best] == pytest.approx(delta.logprobs[0]) == pytest.approx(max(top.values()))
    assert (await collect(engine, prompt, GREEDY))[0].top_logprobs is None


async def test_streamed_text_concatenates_to_full_decode(engine, prompt):
    for seed in range(3):  # a near-uniform random model samples plenty of partial UTF-8 byte tokens
        deltas = await collect(engine, prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=seed))
        ids, _, text, _ = merged(deltas)
        assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_incremental_text_never_splits_a_character(engine):
    detok = IncrementalText(engine.tokenizer)
    ids = engine.tokenizer.encode("héllo 🤖🎉 日本", add_special_tokens=False)
    assert len(ids) > 6  # the emoji are split across byte tokens
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == "héllo 🤖🎉 日本"
    assert all("\ufffd" not in p for p in pieces)


async def test_concurrent_requests_all_complete_and_loop_stays_free(engine, prompt):
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.create_task(ticker())
    params = [SamplingParams(max_tokens=15, temperature=1.0, seed=s) for s in range(4)]
    results = await asyncio.gather(*(collect(engine, prompt, p) for p in params))
    task.cancel()
    for p, deltas in zip(params, results, strict=True):
        assert deltas[-1].finish_reason in ("length", "stop")
        assert merged(deltas) == merged(await collect(engine, prompt, p))  # same as when alone
    assert ticks > 10


async def test_abandoned_stream_does_not_block_the_next(engine, prompt):
    stream = engine.generate(prompt, SamplingParams(max_tokens=500, temperature=1.0, seed=0))
    await anext(stream)
    await stream.aclose()
    deltas = await asyncio.wait_for(collect(engine, prompt, GREEDY), timeout=30)
    assert deltas[-1].finish_reason is not None


async def test_invalid_prompt_is_a_400(engine):
    with pytest.raises(EngineError) as info:
        await collect(engine, [], GREEDY)
    assert info.value.status == 400
    with pytest.raises(EngineError):
        await collect(engine, [engine.model.config.vocab_size], GREEDY)


async def test_swap_weights_changes_outputs_and_version(tiny_model_path, prompt):
    engine = sharpen(TransformersEngine(tiny_model_path, threads=1))
    assert engine.version == 0
    before = merged(await collect(engine, prompt, GREEDY))
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    torch.manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items() if "layers.1." in k}
    await engine.swap_weights(perturbed, version=1)
    assert engine.version == 1
    assert merged(await collect(engine, prompt, GREEDY))[0] != before[0]
    await engine.swap_weights(original, version=2)
    assert engine.version == 2 and merged(await collect(engine, prompt, GREEDY)) == before
    bad = {**perturbed, "no.such.weight": torch.zeros(1)}
    with pytest.raises(ValueError):
        await engine.swap_weights(bad, version=3)
    assert engine.version == 2 and merged(await collect(engine, prompt, GREEDY)) == before  # untouched
    await engine.close()
    with pytest.raises(EngineUnavailable):
        await collect(engine, prompt, GREEDY)


async def test_swap_waits_for_the_running_generation(tiny_model_path, prompt):
    engine = sharpen(TransformersEngine(tiny_model_path, threads=1))
    params = SamplingParams(max_tokens=30, temperature=0)
    before = merged(await collect(engine, prompt, params))
    zeros = {k: torch.zeros_like(v) for k, v in engine.model.state_dict().items() if "layers.0." in k}
    stream = engine.generate(prompt, params)
    deltas = [await anext(stream)]
    swap = asyncio.create_task(engine.swap_weights(zeros, version=7))
    deltas += [d async for d in stream]
    assert merged(deltas) == before  # every token came from version 0
    await swap
    assert engine.version == 7 and merged(await collect(engine, prompt, params))[0] != before[0]
    await engine.close()


async def test_each_named_policy_is_served_by_its_own_line(tiny_model_path, prompt):
    """A named policy's requests get its newest version's weights, or the base model before its first; the
    default line and the other policies keep theirs, whichever order requests come in."""
    engine = TransformersEngine(tiny_model_path, threads=1)

    async def served(line: str | None) -> tuple[list[float], int | None]:
        deltas = await collect(engine, prompt, SamplingParams(max_tokens=4, temperature=0.0, line=line))
        return merged(deltas)[1], deltas[-1].version

    base, _ = await served(None)
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    torch.manual_seed(0)
    default_v1 = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items() if "layers.1." in k}
    support_v3 = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items() if "layers.0." in k}
    await engine.swap_weights(default_v1, version=1)
    default, version = await served(None)
    assert version == 1 and default != base
    assert await served("support") == (base, 0), "no version of its own yet: the base model, version 0"
    await engine.hold_line("support", support_v3, 3)
    assert engine.line_versions() == {"support": 3} and engine.version == 1
    support, version = await served("support")
    assert version == 3 and support not in (base, default)
    assert await served(None) == (default, 1), "the default line is unchanged"
    assert await served("coding") == (base, 0)
    assert await served("support") == (support, 3)
    await engine.swap_weights(original, version=2)  # a default publish while a named line's weights are loaded
    assert await served(None) == (base, 2) and await served("support") == (support, 3)
    await engine.close()
