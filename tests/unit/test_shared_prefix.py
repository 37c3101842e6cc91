"""`train.shared_prefix`: a micro-batch's common beginning runs once and the other rows continue from
its keys and values. It is a speed shortcut, so it is held against the plain pass (every row whole):
the same logprobs, entropies, gradients and optimizer step, up to float rounding."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch

from tracetrain.config import TrainConfig
from tracetrain.trainer.checkpoint import build_model
from tracetrain.trainer.data import Sample, collate, common_prefix, pack, pack_samples
from tracetrain.trainer.step import SampledLogits, StepInputs, sequence_logprobs, train_step

PREFIX = 40
"""Tokens every sample opens with: instructions and worked examples, as the demo agent's prompts do."""


def _samples(rows: int, seed: int = 0) -> list[Sample]:
    """Groups of 4 attempts: a common opening, each group's own question, then attempts of 2 to 9
    tokens (so the rows are right-padded to different lengths)."""
    rng = random.Random(seed)
    opening = [rng.randrange(100, 2000) for _ in range(PREFIX)]
    samples = []
    for row in range(rows):
        if row % 4 == 0:
            question = [rng.randrange(100, 2000) for _ in range(rng.randint(3, 8))]
        answer = [rng.randrange(100, 2000) for _ in range(rng.randint(2, 9))]
        ids = opening + question + answer
        mask = [0] * (len(ids) - len(answer)) + [1] * len(answer)
        logprobs = [0.0] * (len(ids) - len(answer)) + [rng.uniform(-3.0, -0.1) for _ in answer]
        samples.append(Sample(f"s{row}", f"g{row // 4}", ids, mask, logprobs, [0] * len(ids),
                              float(rng.random() < 0.5)))
    return samples


@pytest.fixture
def policy(tiny_model_path: Path) -> SampledLogits:
    torch.manual_seed(0)
    model = build_model(tiny_model_path, TrainConfig())
    with torch.no_grad():  # peft starts B at zero, where every adapter gradient but B's is zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    return SampledLogits(model).train()


def test_common_prefix_counts_the_tokens_every_row_opens_with() -> None:
    assert common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert common_prefix([[1, 2], [1, 2, 3]]) == 2
    assert common_prefix([[7, 2], [1, 2]]) == 0
    assert common_prefix([[1, 2, 3]]) == 0  # one row has nothing to share


def test_a_micro_batch_knows_its_shared_beginning_and_leaves_one_position_to_each_row() -> None:
    samples = _samples(8)
    micro = collate(samples, list(range(8)), pad_id=0)
    assert micro.shared == common_prefix([s.input_ids for s in samples]) >= PREFIX
    same = [Sample("a", "g", [5, 6, 7], [0, 1, 1], [0.0, -1.0, -1.0], [0, 0, 0], 1.0)] * 2
    assert collate(same, [0, 1], pad_id=0).shared == 2  # identical rows: the last position stays per row


def test_the_token_budget_counts_the_shared_beginning_once() -> None:
    lengths = [100] * 8
    assert len(pack(list(range(8)), lengths, 400)) == 2
    assert len(pack(list(range(8)), lengths, 400, shared=80)) == 1  # 80 + 8 x 20 tokens computed
    samples = _samples(16)
    plain = pack_samples(samples, list(range(16)), 300, shared_prefix=False)
    shared = pack_samples(samples, list(range(16)), 300, shared_prefix=True)
    assert len(shared) < len(plain)
    assert sorted(i for batch in shared for i in batch) == list(range(16))


@pytest.mark.parametrize("entropy", [False, True])
def test_shared_prefix_pass_equals_the_plain_pass(policy: SampledLogits, entropy: bool) -> None:
    samples = _samples(12)
    micro = collate(samples, list(range(12)), pad_id=0)
    results = []
    for shared_prefix in (False, True):
        policy.zero_grad(set_to_none=True)
        logprobs, entropies = sequence_logprobs(policy, micro, entropy=entropy, shared_prefix=shared_prefix)
        weights = torch.linspace(-1.0, 1.0, logprobs.numel()).reshape(logprobs.shape)
        loss = (logprobs * weights * micro.mask).sum() + (entropies.sum() if entropies is not None else 0.0)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results.append((logprobs.detach(), entropies, grads))
    (plain, plain_entropy, plain_grads), (shared, shared_entropy, shared_grads) = results
    assert (plain[micro.mask > 0] < 0).all()
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)
    if entropy:
        assert plain_entropy is not None and shared_entropy is not None
        torch.testing.assert_close(shared_entropy.detach(), plain_entropy.detach(), rtol=0, atol=1e-5)
    assert shared_grads.keys() == plain_grads.keys() and any("lora_A" in n for n in plain_grads)
    for name, grad in plain_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6)


def test_a_training_step_with_the_shared_prefix_lands_on_the_same_weights(policy: SampledLogits) -> None:
    samples = _samples(16, seed=1)
    advantages = [s.reward - 0.5 for s in samples]
    after = []
    for shared_prefix in (False, True):
        model = copy.deepcopy(policy)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        cfg = TrainConfig(shared_prefix=shared_prefix, micro_batch_tokens=256, entropy_coef=0.01)
        figures = train_step(model, optimizer, StepInputs(samples, advantages), cfg, pad_id=0)
        after.append((figures, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}))
    (plain_figures, plain), (shared_figures, shared) = after
    assert shared_figures["micro_batches"] < plain_figures["micro_batches"]  # the budget counts it once
    assert shared_figures["loss"] == pytest.approx(plain_figures["loss"], abs=1e-5)
    assert shared_figures["entropy"] == pytest.approx(plain_figures["entropy"], rel=1e-5)
    moved = [n for n in plain if not torch.equal(plain[n], policy.get_parameter(n))]
    assert moved
    for name in plain:
        torch.testing.assert_close(shared[name], plain[name], rtol=0, atol=1e-6)


def test_shared_prefix_is_refused_with_a_setting_that_drops_the_keys_and_values() -> None:
    assert TrainConfig().shared_prefix
    assert not TrainConfig(activation_checkpointing=True).shared_prefix  # off by itself, unasked
    with pytest.raises(ValueError, match="shared_prefix cannot be used with train.torch_compile"):
        TrainConfig(shared_prefix=True, torch_compile=True)
