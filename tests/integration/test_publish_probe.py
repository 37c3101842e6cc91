"""A published version is proven on each replica before it serves there (engines/probe.py).

The real CPU vLLM server on SmolLM2-135M. The probe the trainer would write is computed here with the
trainer's own function (`trainer/step.py` `token_logprobs`) on the weights in question. A replica that
loads other weights than those the probe was computed on is made on purpose: the checkpoint's files are
one adapter (or full model) and its probe another's, which is what a swap that silently serves the
wrong adapter, the old one or the base model looks like from the gateway.
"""

from __future__ import annotations

import asyncio
import copy
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.setup_steps import PEFT_MISSING, TORCH_MISSING

torch = pytest.importorskip("torch", reason=TORCH_MISSING)
pytest.importorskip("peft", reason=PEFT_MISSING)

from peft import PeftModel  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from tests.integration.conftest import put_base_weights_back  # noqa: E402
from tests.integration.test_publish import load_model, save_full, save_lora  # noqa: E402
from tracetrain.engines.probe import PROBE_TEXT, TOLERANCE, Probe, ProbeCheck, read_probe, write_probe  # noqa: E402
from tracetrain.engines.publishing import Checkpoint, PublishError  # noqa: E402
from tracetrain.engines.replica_publish import UNKNOWN_WEIGHTS, ReplicaPublisher  # noqa: E402
from tracetrain.engines.replicas import Replica, ReplicaSet  # noqa: E402
from tracetrain.engines.vllm import VLLMEngine  # noqa: E402
from tracetrain.engines.vllm_publish import VLLMLoRAPublisher, VLLMReloadPublisher  # noqa: E402
from tracetrain.engines.vllm_server import async_http_client, http_client  # noqa: E402
from tracetrain.store.models import DEFAULT_POLICY  # noqa: E402
from tracetrain.trainer.step import SampledLogits, token_logprobs  # noqa: E402

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.vllm]


def probe_for(model: Any, ids: list[int]) -> Probe:
    return Probe(ids, token_logprobs(SampledLogits(model), ids), "float32")


@pytest.fixture(scope="module")
def base(smollm2_path: Path) -> Any:
    return load_model(smollm2_path)


@pytest.fixture(scope="module")
def probe_ids(smollm2_path: Path) -> list[int]:
    ids: list[int] = AutoTokenizer.from_pretrained(str(smollm2_path)).encode(PROBE_TEXT, add_special_tokens=False)
    return ids


@pytest.fixture(scope="module")
def adapters(base: Any, probe_ids: list[int], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`right` and `other`: adapters with their own probes. `wrong`: adapter 2's files with `other`'s probe."""
    root = tmp_path_factory.mktemp("probe")
    right, other, wrong = (save_lora(base, root / name, seed=seed) for name, seed in
                           (("right", 1), ("other", 3), ("wrong", 2)))
    for path in (right, other):
        write_probe(path, probe_for(PeftModel.from_pretrained(copy.deepcopy(base), str(path)), probe_ids))
    shutil.copy(other / "probe.json", wrong / "probe.json")
    return {"right": right, "wrong": wrong, "other": other}


@pytest.fixture
async def replicas(vllm_server: Any) -> AsyncIterator[ReplicaSet]:
    replica_set = ReplicaSet([Replica(VLLMEngine(vllm_server.url, vllm_server.model_name, timeout=120))])
    yield replica_set
    await replica_set.close()


async def test_a_replica_serving_the_trainers_adapter_passes(replicas: ReplicaSet, adapters: dict[str, Path]) -> None:
    publisher = ReplicaPublisher(replicas, [VLLMLoRAPublisher(r.engine, prefix="probe") for r in replicas.replicas],
                                 probe=ProbeCheck("float32"))
    await publisher.publish(Checkpoint(1, adapters["right"], "lora"))
    engine = replicas.replicas[0].engine
    figures = publisher.probes[(DEFAULT_POLICY, 1)][engine.base_url]
    print(f"probe of the right adapter: {figures}")
    assert figures["ok"] and float(figures["mean_diff"]) < TOLERANCE["float32"]
    assert (engine.version, engine.served_model) == (1, "probe-v1")
    assert [e.event for e in replicas.events][-1] == "probe_ok"


async def test_a_refused_adapter_is_never_served_and_the_previous_one_keeps_serving(
    replicas: ReplicaSet, adapters: dict[str, Path], vllm_server: Any,
) -> None:
    """No replica took version 2, so none goes out of service: taking the only replica out over a refused
    version would turn it into an outage (every call a 503) for nothing, as its previous adapter still
    serves."""
    engine = replicas.replicas[0].engine
    publisher = ReplicaPublisher(replicas, [VLLMLoRAPublisher(engine, prefix="probe")], probe=ProbeCheck("float32"))
    await publisher.publish(Checkpoint(1, adapters["right"], "lora"))
    with pytest.raises(PublishError, match="probe does not match"):
        await publisher.publish(Checkpoint(2, adapters["wrong"], "lora"))
    figures = publisher.probes[(DEFAULT_POLICY, 2)][engine.base_url]
    print(f"probe of the wrong adapter: {figures}")
    # A wrong adapter is far outside even bfloat16's wider tolerance, not a rounding matter.
    assert not figures["ok"] and float(figures["mean_diff"]) > TOLERANCE["bfloat16"]
    assert (engine.version, engine.served_model) == (1, "probe-v1")  # never switched to the wrong weights
    assert replicas.router.up == [True]
    events = {e.event for e in replicas.events}
    assert {"probe_failed", "publish_failed"} <= events and "down" not in events
    with http_client(vllm_server.url, timeout=30) as client:
        served = {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert "probe-v1" in served and "probe-v2" not in served  # the refused adapter is unloaded
    async with async_http_client(engine.base_url, timeout=120) as client:
        response = await client.post("/v1/completions", json={
            "model": engine.served_model, "prompt": "Count to 5:", "max_tokens": 4})
    assert response.status_code == 200


async def test_a_policys_probe_is_scored_while_another_adapters_calls_run(replicas: ReplicaSet,
                                                                          adapters: dict[str, Path]) -> None:
    """A named policy published beside another adapter's traffic: the probe shares vLLM's batches with LoRA
    calls of another adapter, which `prompt_logprobs` mis-scores, and on which vLLM's CPU build dies (vLLM
    #16668). The probe must pass, and every call must be answered."""
    engine = replicas.replicas[0].engine
    publisher = ReplicaPublisher(replicas, [VLLMLoRAPublisher(engine, prefix="probe")], probe=ProbeCheck("float32"))
    await publisher.publish(Checkpoint(1, adapters["right"], "lora"))

    async def call(i: int) -> int:
        async with async_http_client(engine.base_url, timeout=120) as client:
            response = await client.post("/v1/completions", json={
                "model": "probe-v1", "prompt": f"Count to {i + 20}:", "max_tokens": 48, "temperature": 1.0})
        return response.status_code

    traffic = [asyncio.create_task(call(i)) for i in range(8)]
    await asyncio.sleep(0.5)  # the calls are decoding when the policy's adapter is loaded and probed
    await publisher.publish_line(Checkpoint(1, adapters["other"], "lora", line="support"))
    assert await asyncio.gather(*traffic) == [200] * 8
    figures = publisher.probes[("support", 1)][engine.base_url]
    print(f"probe under another adapter's traffic: {figures}")
    assert figures["ok"] and float(figures["mean_diff"]) < TOLERANCE["float32"]
    assert replicas.router.up == [True]
    assert engine.line_versions().get("support") == 1


async def test_a_full_reload_that_serves_other_weights_is_taken_out(
    replicas: ReplicaSet, base: Any, probe_ids: list[int], smollm2_path: Path, vllm_server: Any,
    tmp_path: Path,
) -> None:
    """Full weights reloaded in place: the replica now holds weights that are neither the old version's
    nor the trainer's, so it goes out with an unknown version until the health check's catch-up."""
    engine = replicas.replicas[0].engine
    path, _ = save_full(base, smollm2_path, tmp_path / "full", seed=5)
    write_probe(path, probe_for(base, probe_ids))  # the base model's scores: the weights moved since
    publisher = ReplicaPublisher(replicas, [VLLMReloadPublisher(engine, smollm2_path)], probe=ProbeCheck("float32"))
    try:
        with pytest.raises(PublishError, match="probe does not match"):
            await publisher.publish(Checkpoint(1, path, "full"))
        assert engine.version == UNKNOWN_WEIGHTS and replicas.router.up == [False]
        assert read_probe(path) is not None
    finally:  # the server is shared with other modules: its own weights back
        put_base_weights_back(vllm_server)
