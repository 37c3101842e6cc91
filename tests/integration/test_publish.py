"""Publishing trained checkpoints into running engines: vLLM by LoRA load and by in-place reload (the
real CPU server, SmolLM2-135M), and the in-process transformers engine (tiny model).

What each path must guarantee: after `publish` the engine serves exactly the checkpoint's weights
(vLLM's logprobs equal transformers' on the same weights, the number the trainer relies on), a bad
checkpoint raises `PublishError` and leaves the previous version serving, and requests running
during a publish all finish.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.support.setup_steps import PEFT_MISSING, TORCH_MISSING

torch = pytest.importorskip("torch", reason=TORCH_MISSING)
pytest.importorskip("peft", reason=PEFT_MISSING)

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from sqlmodel import Session  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from tracetrain.engines import vllm_publish  # noqa: E402
from tracetrain.engines.base import SamplingParams, TokenDelta  # noqa: E402
from tracetrain.engines.publishing import Checkpoint, PublishError  # noqa: E402
from tracetrain.engines.replica_publish import ReplicaPublisher  # noqa: E402
from tracetrain.engines.replicas import Replica, ReplicaSet  # noqa: E402
from tracetrain.engines.transformers_engine import TransformersEngine  # noqa: E402
from tracetrain.engines.transformers_publish import InProcessPublisher  # noqa: E402
from tracetrain.engines.vllm import VLLMEngine  # noqa: E402
from tracetrain.engines.vllm_publish import VLLMLoRAPublisher, VLLMReloadPublisher  # noqa: E402
from tracetrain.engines.vllm_server import async_http_client, http_client  # noqa: E402
from tracetrain.engines.weight_transfer import SHARED_MEMORY  # noqa: E402
from tracetrain.proxy.replica_sync import ReplicaSync  # noqa: E402
from tracetrain.store.db import open_db  # noqa: E402
from tracetrain.store.writer import StoreWriter  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="session")
vllm = pytest.mark.vllm

LOGPROB_TOLERANCE = 1e-3
"""vLLM (CPU, float32) against transformers on the same weights: measured max |diff| about 4e-5."""

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# --- checkpoints ---------------------------------------------------------------------------------------


def load_model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def save_lora(base: Any, path: Path, *, seed: int, rank: int = 8, scale: float = 0.02) -> Path:
    """A PEFT adapter on a copy of `base` with random non-zero B (peft starts B at zero, a no-op)."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS)
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, scale)
    model.save_pretrained(str(path))
    return path


def merged_lora(base: Any, adapter: Path) -> Any:
    return PeftModel.from_pretrained(copy.deepcopy(base), str(adapter)).merge_and_unload().eval()


def save_full(
    base: Any, tokenizer_dir: Path, path: Path, *, seed: int, scale: float = 0.01
) -> tuple[Path, Any]:
    """A complete model directory with every MLP down-projection perturbed, as the trainer writes it."""
    torch.manual_seed(seed)
    model = copy.deepcopy(base)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "down_proj" in name:
                param.add_(torch.randn_like(param) * scale)
    model.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
    return path, model


def hf_logprobs(model: Any, ids: list[int], start: int) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= start, from raw logits (vLLM's raw_logprobs)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(start, len(ids))]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def generate(engine: Any, prompt: list[int], params: SamplingParams = GREEDY) -> list[TokenDelta]:
    return [delta async for delta in engine.generate(prompt, params)]


def token_ids(deltas: list[TokenDelta]) -> list[int]:
    assert deltas and deltas[-1].finish_reason in ("stop", "length")
    return [t for d in deltas for t in d.token_ids]


def sampled_logprobs(deltas: list[TokenDelta]) -> list[float]:
    return [lp for d in deltas for lp in d.logprobs]


async def run_during(engine: Any, prompt: list[int], publish: Callable[[], Any], *, n: int = 8,
                     max_tokens: int = 32, started_before: int | None = None
                     ) -> list[BaseException | list[TokenDelta]]:
    """`n` concurrent streaming requests; `publish()` runs once `started_before` of them (all by default)
    have their first token. The in-process engine serves one request at a time, so there it is 1."""
    started = asyncio.Event()
    first_tokens = 0
    wanted = started_before or n

    async def one(i: int) -> list[TokenDelta]:
        nonlocal first_tokens
        deltas: list[TokenDelta] = []
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i)
        async for delta in engine.generate(prompt, params):
            if not deltas:
                first_tokens += 1
                if first_tokens == wanted:
                    started.set()
            deltas.append(delta)
        return deltas

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await asyncio.wait_for(started.wait(), timeout=120)
    assert not all(t.done() for t in tasks), "requests finished before the publish: make them longer"
    await publish()
    return list(await asyncio.gather(*tasks, return_exceptions=True))


def assert_all_finished(results: list[BaseException | list[TokenDelta]], max_tokens: int = 32) -> None:
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} requests failed during the publish: {failed[:3]}"
    for deltas in results:
        assert isinstance(deltas, list)
        assert deltas[-1].finish_reason in ("stop", "length"), deltas[-1].finish_reason  # never "abort"
        assert deltas[-1].finish_reason == "stop" or len(token_ids(deltas)) == max_tokens


# --- vLLM ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> Any:
    return load_model(smollm2_path)


@pytest.fixture(scope="module")
def prompt(smollm2_path: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    messages = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


@pytest.fixture(scope="module")
def lora_dirs(smollm2: Any, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("lora")
    return [save_lora(smollm2, root / f"v{v}", seed=v) for v in (1, 2, 3)]


@pytest.fixture(scope="module")
def full_checkpoint(
    smollm2: Any, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any]:
    return save_full(smollm2, smollm2_path, tmp_path_factory.mktemp("full") / "v1", seed=11)


@pytest.fixture
async def engine(vllm_server: Any) -> AsyncIterator[VLLMEngine]:
    engine = VLLMEngine(vllm_server.url, vllm_server.model_name, timeout=120)
    yield engine
    await engine.close()


async def vllm_prompt_logprobs(engine: VLLMEngine, ids: list[int], start: int) -> list[float]:
    """vLLM's logprob of each token of `ids` from `start` on, scored by the adapter the engine serves."""
    body = {"model": engine.served_model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
    async with async_http_client(engine.base_url, timeout=120) as client:
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    scored = response.json()["choices"][0]["prompt_logprobs"]
    return [scored[i][str(ids[i])]["logprob"] for i in range(start, len(ids))]


async def assert_matches(
    engine: VLLMEngine, reference: Any, prompt: list[int], deltas: list[TokenDelta]
) -> float:
    """vLLM's sampled and prompt logprobs of the generated sequence equal transformers' on `reference`."""
    ids = prompt + token_ids(deltas)
    expected = hf_logprobs(reference, ids, len(prompt))
    scored = max_diff(await vllm_prompt_logprobs(engine, ids, len(prompt)), expected)
    sampled = max_diff(sampled_logprobs(deltas), expected)
    print(f"max |vLLM - transformers| logprob: prompt_logprobs {scored:.2e}, sampled {sampled:.2e}")
    assert scored < LOGPROB_TOLERANCE and sampled < LOGPROB_TOLERANCE
    return max(scored, sampled)


@vllm
async def test_lora_publish_serves_the_adapter(engine, smollm2, prompt, lora_dirs):
    before = token_ids(await generate(engine, prompt))
    await VLLMLoRAPublisher(engine).publish(Checkpoint(1, lora_dirs[0], "lora"))
    assert (engine.version, engine.served_model) == (1, "policy-v1")

    deltas = await generate(engine, prompt)
    assert token_ids(deltas) != before
    await assert_matches(engine, merged_lora(smollm2, lora_dirs[0]), prompt, deltas)


@vllm
async def test_named_policies_are_served_their_own_adapters_beside_the_default_line(engine, smollm2, prompt,
                                                                                   lora_dirs):
    """Named policies (docs/architecture.md, decision 13): each policy's requests get its own newest adapter,
    a policy with none the base model as its version 0, and the default line keeps its own version."""
    publisher = VLLMLoRAPublisher(engine, prefix="lines")
    await publisher.publish(Checkpoint(1, lora_dirs[0], "lora"))
    base = await generate(engine, prompt, replace(GREEDY, line="quiet"))
    assert {d.version for d in base} == {0}
    assert max_diff(sampled_logprobs(base), hf_logprobs(smollm2, prompt + token_ids(base), len(prompt))) \
        < LOGPROB_TOLERANCE  # the base model's weights, not the default line's adapter

    await publisher.publish_line(Checkpoint(1, lora_dirs[1], "lora", line="support"))
    await publisher.publish_line(Checkpoint(2, lora_dirs[2], "lora", line="support"))
    assert engine.line_versions() == {"support": 2}
    support = await generate(engine, prompt, replace(GREEDY, line="support"))
    assert {d.version for d in support} == {2}
    expected = hf_logprobs(merged_lora(smollm2, lora_dirs[2]), prompt + token_ids(support), len(prompt))
    assert max_diff(sampled_logprobs(support), expected) < LOGPROB_TOLERANCE  # version 2's weights sampled them
    default = await generate(engine, prompt)
    assert {d.version for d in default} == {1}
    await assert_matches(engine, merged_lora(smollm2, lora_dirs[0]), prompt, default)
    assert {d.version for d in await generate(engine, prompt, replace(GREEDY, line="quiet"))} == {0}


@vllm
async def test_a_canary_adapter_serves_next_to_the_current_one(engine, smollm2, prompt, lora_dirs):
    """Canary promotion with LoRA: both adapters in one vLLM; a request asking for the canary's version gets
    its weights (logprobs match the merged model), every other request the current version's. (Placed before
    the full-weight reload tests: they change the server's base weights until the module ends.)"""
    publisher = VLLMLoRAPublisher(engine, prefix="canary")
    await publisher.publish(Checkpoint(1, lora_dirs[0], "lora"))
    await publisher.stage(Checkpoint(2, lora_dirs[1], "lora"))
    assert engine.version == 1
    on_canary = await generate(engine, prompt, replace(GREEDY, version=2))
    assert {d.version for d in on_canary} == {2}
    expected = hf_logprobs(merged_lora(smollm2, lora_dirs[1]), prompt + token_ids(on_canary), len(prompt))
    assert max_diff(sampled_logprobs(on_canary), expected) < LOGPROB_TOLERANCE  # version 2's weights sampled them
    current = await generate(engine, prompt)
    assert {d.version for d in current} == {1} and token_ids(current) != token_ids(on_canary)

    await publisher.retire(2)  # rolled back: asking for it gets the current version
    assert {d.version for d in await generate(engine, prompt, replace(GREEDY, version=2))} == {1}
    await publisher.stage(Checkpoint(3, lora_dirs[2], "lora"))
    await publisher.promote(Checkpoint(3, lora_dirs[2], "lora"))
    assert (engine.version, engine.served_model) == (3, "canary-v3")
    assert {d.version for d in await generate(engine, prompt, replace(GREEDY, version=1))} == {1}  # still held


@vllm
async def test_a_named_policys_canary_serves_next_to_its_current_version(engine, smollm2, prompt, lora_dirs):
    """Canary promotion of a named policy's line: its canary is asked for by (policy, version); the policy's
    other requests get its current version, the default line and other policies are untouched."""
    publisher = VLLMLoRAPublisher(engine, prefix="linecanary")
    await publisher.publish_line(Checkpoint(1, lora_dirs[0], "lora", line="support"))
    default_before = engine.version
    await publisher.stage(Checkpoint(2, lora_dirs[1], "lora", line="support"))
    assert engine.line_versions()["support"] == 1
    on_canary = await generate(engine, prompt, replace(GREEDY, line="support", version=2))
    assert {d.version for d in on_canary} == {2}
    expected = hf_logprobs(merged_lora(smollm2, lora_dirs[1]), prompt + token_ids(on_canary), len(prompt))
    assert max_diff(sampled_logprobs(on_canary), expected) < LOGPROB_TOLERANCE  # version 2's weights sampled them
    assert {d.version for d in await generate(engine, prompt, replace(GREEDY, line="support"))} == {1}
    assert {d.version for d in await generate(engine, prompt, replace(GREEDY, line="other", version=2))} == {0}
    assert engine.version == default_before

    await publisher.retire(2, "support")  # rolled back: asking for it gets the line's current version
    assert {d.version for d in await generate(engine, prompt, replace(GREEDY, line="support", version=2))} == {1}
    await publisher.stage(Checkpoint(3, lora_dirs[2], "lora", line="support"))
    await publisher.promote(Checkpoint(3, lora_dirs[2], "lora", line="support"))
    assert engine.lines["support"] == (3, "linecanary-support-v3") and not engine.line_canaries
    served = await generate(engine, prompt, replace(GREEDY, line="support"))
    expected = hf_logprobs(merged_lora(smollm2, lora_dirs[2]), prompt + token_ids(served), len(prompt))
    assert {d.version for d in served} == {3} and max_diff(sampled_logprobs(served), expected) < LOGPROB_TOLERANCE

@vllm
async def test_lora_requests_in_flight_survive_publishes_and_unloads(engine, prompt, lora_dirs, vllm_server):
    publisher = VLLMLoRAPublisher(engine, prefix="flight")
    await publisher.publish(Checkpoint(1, lora_dirs[0], "lora"))

    async def two_more_versions() -> None:  # the second unloads v1, which the running requests use
        await publisher.publish(Checkpoint(2, lora_dirs[1], "lora"))
        await publisher.publish(Checkpoint(3, lora_dirs[2], "lora"))

    assert_all_finished(await run_during(engine, prompt, two_more_versions))
    assert (engine.version, publisher.loaded) == (3, ["flight-v2", "flight-v3"])
    with http_client(vllm_server.url, timeout=30) as client:
        models = client.get("/v1/models").json()["data"]
    assert "flight-v1" not in {m["id"] for m in models}
    token_ids(await generate(engine, prompt))


@vllm
async def test_bad_lora_checkpoints_leave_the_served_version(engine, prompt, lora_dirs, smollm2, tmp_path):
    publisher = VLLMLoRAPublisher(engine)
    await publisher.publish(Checkpoint(1, lora_dirs[0], "lora"))
    served = token_ids(await generate(engine, prompt))

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((lora_dirs[0] / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    too_wide = save_lora(smollm2, tmp_path / "rank32", seed=5, rank=32)  # the server allows rank 16
    bad = [
        (Checkpoint(2, tmp_path / "missing", "lora"), "no adapter_config.json"),
        (Checkpoint(2, corrupt, "lora"), "unreadable safetensors header"),
        (Checkpoint(2, too_wide, "lora"), "vLLM refused LoRA policy-v2"),
        (Checkpoint(2, lora_dirs[1].parent, "full"), "publishes lora checkpoints"),
    ]
    for checkpoint, message in bad:
        with pytest.raises(PublishError, match=message):
            await publisher.publish(checkpoint)
        assert (engine.version, engine.served_model) == (1, "policy-v1")
    assert token_ids(await generate(engine, prompt)) == served


@vllm
async def test_reload_publish_serves_the_full_checkpoint(
    engine, vllm_server, prompt, full_checkpoint, restore_base_weights
):
    before = token_ids(await generate(engine, prompt))
    path, model = full_checkpoint
    await VLLMReloadPublisher(engine, vllm_server.model_dir).publish(Checkpoint(7, path, "full"))
    assert (engine.version, engine.served_model) == (7, vllm_server.model_name)

    deltas = await generate(engine, prompt)
    assert token_ids(deltas) != before
    await assert_matches(engine, model, prompt, deltas)


@vllm
async def test_full_weights_sent_from_memory_serve_exactly_the_checkpoint(
    engine, vllm_server, prompt, full_checkpoint, restore_base_weights
):
    """The trainer's tensors reach vLLM through /dev/shm (the shared server runs the `tracetrain_shm`
    backend), not through the checkpoint's files; the shared file is gone afterwards."""
    path, model = full_checkpoint
    publisher = VLLMReloadPublisher(engine, vllm_server.model_dir, transfer=SHARED_MEMORY)
    await publisher.publish(Checkpoint(8, path, "full", weights=lambda: model.state_dict().items()))
    assert publisher.last_route == "memory" and engine.version == 8
    await assert_matches(engine, model, prompt, await generate(engine, prompt))
    assert not list(Path("/dev/shm").glob("tracetrain-weights-*"))


@vllm
async def test_fsdp_weights_sent_from_memory_serve_exactly_its_checkpoint(
    engine, vllm_server, prompt, smollm2_path, tmp_path, restore_base_weights
):
    """The fsdp backend (2 Ray workers on this CPU, LoRA merged as the demo publishes it) after a step: its
    weights are gathered from the workers into this process and sent to vLLM through /dev/shm. They are the
    checkpoint's, tensor for tensor and name for name, and vLLM then serves that checkpoint's logprobs."""
    ray = pytest.importorskip("ray", reason="the distributed extra (Ray) is not installed")
    from tests.support.fsdp_step import train_config, trajectories
    from tracetrain.trainer.backend import StepBatch
    from tracetrain.trainer.checkpoint import MERGED_DIR
    from tracetrain.trainer.fsdp_backend import FSDPBackend

    path = tmp_path / "v000001"
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        backend = FSDPBackend(train_config(tmp_path, lora=True, workers=2, lr=1e-2), smollm2_path, None)
        try:
            backend.step(StepBatch(*trajectories()))
            path.mkdir()
            backend.save(path, merged=True)
            weights = dict(backend.served_weights(merged=True))
        finally:
            backend.close()
    finally:
        ray.shutdown()
    on_disk = load_file(str(path / MERGED_DIR / "model.safetensors"))
    assert set(weights) == set(on_disk) and all(torch.equal(weights[k], on_disk[k]) for k in on_disk)
    base = load_file(str(smollm2_path / "model.safetensors"))
    assert any(not torch.equal(on_disk[k], base[k].to(on_disk[k].dtype)) for k in on_disk)  # the step moved them

    publisher = VLLMReloadPublisher(engine, vllm_server.model_dir, transfer=SHARED_MEMORY)
    await publisher.publish(Checkpoint(10, path / MERGED_DIR, "full", weights=lambda: weights.items()))
    assert publisher.last_route == "memory" and engine.version == 10
    await assert_matches(engine, load_model(path / MERGED_DIR), prompt, await generate(engine, prompt))


@vllm
async def test_a_transfer_vllm_refuses_falls_back_to_the_checkpoint_on_disk(
    engine, vllm_server, prompt, full_checkpoint, restore_base_weights
):
    path, model = full_checkpoint
    publisher = VLLMReloadPublisher(engine, vllm_server.model_dir, transfer=SHARED_MEMORY)
    wrong = {"model.norm.weight": torch.zeros(3)}  # the model's norm has 576 entries
    await publisher.publish(Checkpoint(9, path, "full", weights=lambda: wrong.items()))
    assert publisher.last_route == "disk" and engine.version == 9
    await assert_matches(engine, model, prompt, await generate(engine, prompt))


@vllm
async def test_a_restarted_gateway_reloads_the_version_its_store_says_is_served(
    engine, vllm_server, prompt, full_checkpoint, restore_base_weights, tmp_path
):
    """`serve --train` restarted on its store: its vLLM holds the base weights while the store says version
    3 is served. Following the store (what `_follow_versions` calls), the gateway reloads version 3, agreed
    with any other gateway process through the store, and records it there; before, it only moved the label
    it could not move, and retried every second. A second process on the same replica relabels without
    reloading, and a version older than the replica's is never loaded over it."""
    path, model = full_checkpoint
    db = open_db(f"sqlite:///{tmp_path / 'store.db'}")

    async def process() -> tuple[ReplicaPublisher, ReplicaSync, StoreWriter]:
        writer = StoreWriter(db)

        async def read(fn: Callable[[Session], Any]) -> Any:
            def run() -> Any:
                with Session(db) as session:
                    return fn(session)
            return await asyncio.to_thread(run)

        own = VLLMEngine(vllm_server.url, vllm_server.model_name, timeout=120)
        replicas = ReplicaSet([Replica(own)])
        publisher = ReplicaPublisher(replicas, [VLLMReloadPublisher(own, vllm_server.model_dir)])
        sync = ReplicaSync(replicas, read=read, write=writer.submit, base_weights=vllm_server.model_dir)
        publisher.coordinator = sync
        await writer.start()
        await sync.start()
        return publisher, sync, writer

    first, first_sync, first_writer = await process()
    second, second_sync, second_writer = await process()
    reloads: list[int] = []
    original = VLLMReloadPublisher.publish

    async def counted(self: VLLMReloadPublisher, checkpoint: Checkpoint) -> None:
        reloads.append(checkpoint.version)
        await original(self, checkpoint)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(VLLMReloadPublisher, "publish", counted)
            await first.adopt(Checkpoint(3, path, "full"))
            await second.adopt(Checkpoint(3, path, "full"))  # another process: the store says it is there
            await second.adopt(Checkpoint(2, vllm_server.model_dir, "full"))  # older: never loaded over it
        assert reloads == [3]
        served = first.replicas.replicas[0].engine
        assert served.version == 3 and second.replicas.replicas[0].engine.version == 3
        deltas = await generate(served, prompt)
        await assert_matches(served, model, prompt, deltas)
    finally:
        for publisher, sync, writer in ((first, first_sync, first_writer), (second, second_sync, second_writer)):
            await sync.stop()
            await writer.stop()
            await publisher.replicas.close()


@vllm
async def test_reload_requests_in_flight_all_finish(engine, vllm_server, prompt, full_checkpoint,
                                                     restore_base_weights):
    publisher = VLLMReloadPublisher(engine, vllm_server.model_dir)
    path, _ = full_checkpoint

    async def publish() -> None:
        await publisher.publish(Checkpoint(8, path, "full"))

    assert_all_finished(await run_during(engine, prompt, publish))
    assert engine.version == 8
    token_ids(await generate(engine, prompt))


@vllm
async def test_bad_full_checkpoints_leave_the_served_version(
    engine, vllm_server, prompt, full_checkpoint, tiny_model_path, tmp_path, restore_base_weights
):
    path, _ = full_checkpoint
    publisher = VLLMReloadPublisher(engine, vllm_server.model_dir)
    await publisher.publish(Checkpoint(1, path, "full"))
    served = token_ids(await generate(engine, prompt))

    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text((path / "config.json").read_text())
    data = (path / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    bad = [
        (Checkpoint(2, tmp_path / "missing", "full"), "does not exist"),
        (Checkpoint(2, tiny_model_path, "full"), "does not match the served model"),
        (Checkpoint(2, truncated, "full"), "truncated"),
        (Checkpoint(2, path, "lora"), "publishes full checkpoints"),
    ]
    for checkpoint, message in bad:
        with pytest.raises(PublishError, match=message):
            await publisher.publish(checkpoint)
        assert engine.version == 1
    assert token_ids(await generate(engine, prompt)) == served


@vllm
async def test_a_reload_failing_inside_vllm_restores_the_previous_weights(
    engine, vllm_server, prompt, full_checkpoint, tmp_path, monkeypatch, restore_base_weights
):
    """vLLM moves every layer to the meta device before reading the files; a reload that fails halfway
    would leave an engine that dies on its next request unless the publisher reloads good weights."""
    path, _ = full_checkpoint
    publisher = VLLMReloadPublisher(engine, vllm_server.model_dir)
    await publisher.publish(Checkpoint(1, path, "full"))
    served = token_ids(await generate(engine, prompt))

    state = load_file(str(path / "model.safetensors"))
    names = sorted(state)
    half_bad = tmp_path / "half-bad"
    half_bad.mkdir()
    first_half = {k: state[k] for k in names[: len(names) // 2]}
    save_file(first_half, str(half_bad / "model-00001-of-00002.safetensors"))
    (half_bad / "model-00002-of-00002.safetensors").write_bytes(b"\x00" * 64)  # not safetensors at all
    monkeypatch.setattr(vllm_publish, "check_full_checkpoint", lambda *args: None)  # let vLLM find out

    with pytest.raises(PublishError, match="failed to reload weights"):
        await publisher.publish(Checkpoint(2, half_bad, "full"))
    assert engine.version == 1 and publisher.current_weights == path
    assert token_ids(await generate(engine, prompt)) == served


# --- in-process ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path) -> TransformersEngine:
    """A private engine: publishing changes its weights, so it is not the shared `tiny_engine`."""
    return TransformersEngine(tiny_model_path, model_name="tiny-publish")


@pytest.fixture(scope="module")
def tiny_base(tiny_model_path: Path) -> Any:
    return load_model(tiny_model_path)


TINY_PROMPT = [1, 504, 3458, 282, 4649, 314]


def assert_serves(deltas: list[TokenDelta], reference: Any) -> None:
    ids = TINY_PROMPT + token_ids(deltas)
    assert max_diff(sampled_logprobs(deltas), hf_logprobs(reference, ids, len(TINY_PROMPT))) < 1e-4


async def test_in_process_full_and_lora(tiny, tiny_base, tiny_model_path, tmp_path):
    publisher = InProcessPublisher(tiny)
    base_ids = token_ids(await generate(tiny, TINY_PROMPT))

    full_dir, full_model = save_full(tiny_base, tiny_model_path, tmp_path / "full", seed=3, scale=0.5)
    await publisher.publish(Checkpoint(1, full_dir, "full"))
    assert tiny.version == 1
    deltas = await generate(tiny, TINY_PROMPT)
    assert token_ids(deltas) != base_ids
    assert_serves(deltas, full_model)

    for version in (2, 3):  # each adapter is merged into the base weights, not into the version served
        adapter = save_lora(tiny_base, tmp_path / f"lora{version}", seed=version, scale=0.5)
        await publisher.publish(Checkpoint(version, adapter, "lora"))
        assert tiny.version == version
        assert_serves(await generate(tiny, TINY_PROMPT), merged_lora(tiny_base, adapter))

    await publisher.publish(Checkpoint(4, tiny_model_path, "full"))
    assert token_ids(await generate(tiny, TINY_PROMPT)) == base_ids


async def test_in_process_bad_checkpoints_leave_the_served_version(
    tiny, tiny_base, tiny_model_path, smollm2_path, tmp_path
):
    publisher = InProcessPublisher(tiny)
    version = tiny.version
    served = token_ids(await generate(tiny, TINY_PROMPT))
    not_lora = tmp_path / "not-lora"
    not_lora.mkdir()
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    data = (tiny_model_path / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-100])  # a checkpoint still being written
    bad = [
        (Checkpoint(version + 1, tmp_path / "missing", "full"), "does not exist"),
        (Checkpoint(version + 1, smollm2_path, "full"), "does not fit the served model"),
        (Checkpoint(version + 1, truncated, "full"), "truncated"),
        (Checkpoint(version + 1, not_lora, "lora"), "no adapter_config.json"),
    ]
    for checkpoint, message in bad:
        with pytest.raises(PublishError, match=message):
            await publisher.publish(checkpoint)
        assert tiny.version == version
    assert token_ids(await generate(tiny, TINY_PROMPT)) == served


async def test_in_process_requests_in_flight_all_finish(tiny, tiny_base, tmp_path):
    publisher = InProcessPublisher(tiny)
    adapter = save_lora(tiny_base, tmp_path / "lora", seed=9, scale=0.5)

    async def publish() -> None:
        await publisher.publish(Checkpoint(tiny.version + 1, adapter, "lora"))

    results = await run_during(tiny, TINY_PROMPT, publish, max_tokens=64, started_before=1)
    assert_all_finished(results, max_tokens=64)

