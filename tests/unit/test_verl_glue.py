"""The glue from store rows to verl's tensors: masks, grouping, packing, estimator and loss registries."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tracetrain.config import TrainConfig
from tracetrain.trainer.algorithms import verl_ops
from tracetrain.trainer.algorithms.baseline import RunningBaseline
from tracetrain.trainer.data import Sample, balance, collate, pack, zero_variance_groups
from tracetrain.trainer.step import rl_advantages


def _sample(group: str, reward: float, n_prompt: int = 3, n_sampled: int = 2, session: str = "") -> Sample:
    ids = list(range(10, 10 + n_prompt + n_sampled))
    mask = [0] * n_prompt + [1] * n_sampled
    return Sample(session or f"s-{group}-{reward}", group, ids, mask, [0.0] * n_prompt + [-0.5] * n_sampled,
                  [-1] * n_prompt + [3] * n_sampled, reward)


def test_outcome_reward_sits_on_the_last_sampled_token() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    rewards = verl_ops.outcome_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert rewards.tolist() == [[0, 0, 2, 0], [3, 0, 0, 0], [0, 0, 0, 0]]


def test_grpo_and_rloo_from_verl_match_hand_values() -> None:
    mask = torch.ones(4, 1)
    rewards = torch.tensor([1.0, 0.0, 1.0, 5.0])
    groups = ["a", "a", "b", "b"]
    grpo = verl_ops.compute_advantages("grpo", rewards, mask, groups)[:, 0]
    std = torch.tensor([1.0, 0.0]).std().item()
    assert grpo.tolist() == pytest.approx([0.5 / std, -0.5 / std, -2 / torch.tensor([1.0, 5.0]).std().item(),
                                           2 / torch.tensor([1.0, 5.0]).std().item()], rel=1e-4)
    rloo = verl_ops.compute_advantages("rloo", rewards, mask, groups)[:, 0]
    assert rloo.tolist() == pytest.approx([1.0, -1.0, -4.0, 4.0])  # (r_i - mean of others) * n/(n-1) = r_i - r_j


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus", "remax"])
def test_every_configured_estimator_runs(name: str) -> None:
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [1, 1, 1], [0, 0, 1]], dtype=torch.float32)
    advantages = verl_ops.compute_advantages(name, torch.tensor([1.0, 0.0, 0.5, 0.2]), mask, ["a", "a", "b", "b"])
    assert advantages.shape == mask.shape
    assert torch.all(advantages[mask == 0] == 0)


@pytest.mark.parametrize("loss", ["vanilla", "gspo", "cispo", "sapo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_policy_losses_give_the_policy_gradient_at_ratio_one(loss: str, agg: str) -> None:
    """At ratio 1 (fresh samples) every loss pushes up tokens with positive advantage."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    advantages = torch.tensor([[0.0, 1.0, 1.0]])
    config = verl_ops.actor_config(loss, clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                                   loss_agg_mode=agg, batch_num_tokens=2, global_batch_size=1)
    value, _ = verl_ops.policy_loss(loss, logprobs.detach(), logprobs, advantages, mask, config)
    value.backward()
    assert logprobs.grad is not None
    assert logprobs.grad[0, 0] == 0 and torch.all(logprobs.grad[0, 1:] < 0)


def test_a_user_registered_loss_is_selectable_by_name() -> None:
    from verl.trainer.ppo.core_algos import register_policy_loss

    @register_policy_loss("tt_test_plain_pg")  # type: ignore[arg-type]
    def plain_pg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                 rollout_is_weights=None):  # type: ignore[no-untyped-def]
        return -(advantages * log_prob * response_mask).sum() / response_mask.sum(), {"custom": 1.0}

    config = verl_ops.actor_config("tt_test_plain_pg", clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                                   loss_agg_mode="token-mean", batch_num_tokens=2, global_batch_size=1)
    logprobs = torch.tensor([[-1.0, -2.0]])
    value, metrics = verl_ops.policy_loss("tt_test_plain_pg", logprobs, logprobs, torch.ones(1, 2),
                                          torch.ones(1, 2), config)
    assert float(value) == pytest.approx(1.5) and metrics == {"custom": 1.0}
    assert TrainConfig(policy_loss="tt_test_plain_pg").policy_loss == "tt_test_plain_pg"


def test_singletons_use_the_running_baseline_and_groups_use_verl() -> None:
    samples = [_sample("a", 1.0), _sample("a", 0.0), _sample("solo", 0.7)]
    baseline = RunningBaseline(momentum=0.5)
    advantages = rl_advantages(samples, TrainConfig(advantage="rloo"), baseline)
    assert advantages == pytest.approx([1.0, -1.0, 0.7])
    assert baseline.value("solo") == pytest.approx(0.7)


def test_flat_groups_are_trained_against_the_running_baseline_when_asked() -> None:
    """An all-fail and an all-success group beside a mixed one: verl alone gives the flat groups nothing
    (`set_aside` or `keep`); with `flat_groups: baseline`, the default, every member gets its reward minus
    the baseline as it stood before the group, whatever its place in the group."""
    samples = [_sample("fail", 0.0), _sample("fail", 0.0), _sample("win", 1.0), _sample("win", 1.0),
               _sample("mixed", 1.0), _sample("mixed", 0.0)]
    assert TrainConfig().flat_groups == "baseline"
    plain = rl_advantages(samples, TrainConfig(advantage="rloo", flat_groups="keep"), RunningBaseline(momentum=0.5))
    assert plain[:4] == [0.0, 0.0, 0.0, 0.0]
    baseline = RunningBaseline(momentum=0.5, overall=0.25)
    advantages = rl_advantages(samples, TrainConfig(advantage="rloo", flat_groups="baseline"), baseline)
    assert advantages[:2] == pytest.approx([-0.25, -0.25])  # both against the overall 0.25
    # then against the overall after those two failures at momentum 0.5: 0.25 -> 0.125 -> 0.0625
    assert advantages[2:4] == pytest.approx([0.9375, 0.9375])
    assert advantages[4:] == pytest.approx([1.0, -1.0])  # the mixed group keeps verl's RLOO
    assert baseline.value("fail") == pytest.approx(0.0) and baseline.value("win") == pytest.approx(1.0)


def test_zero_variance_groups_are_found() -> None:
    samples = [_sample("a", 1.0), _sample("a", 1.0), _sample("b", 1.0), _sample("b", 0.0), _sample("c", 0.0)]
    assert zero_variance_groups(samples) == {"a"}


def test_packing_respects_the_token_budget() -> None:
    lengths = [10, 3, 8, 3, 12, 1]
    batches = pack(list(range(6)), lengths, token_budget=16)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 16


def test_collate_shifts_mask_and_logprobs_onto_targets() -> None:
    samples = [_sample("a", 1.0, n_prompt=2, n_sampled=2), _sample("b", 0.0, n_prompt=1, n_sampled=1)]
    mb = collate(samples, [0, 1], pad_id=0)
    assert mb.input_ids.tolist() == [[10, 11, 12, 13], [10, 11, 0, 0]]
    assert mb.targets.tolist() == [[11, 12, 13], [11, 0, 0]]
    assert mb.mask.tolist() == [[0, 1, 1], [1, 0, 0]]  # target 12 and 13 were sampled; 11 in row 2
    assert mb.behaviour_logprobs.tolist() == [[0.0, -0.5, -0.5], [-0.5, 0.0, 0.0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


def test_unknown_algorithm_names_are_refused_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for field, value in (("advantage", "nosuch"), ("policy_loss", "nosuch"), ("loss_agg_mode", "nosuch"),
                         ("plugins", ["no_such_module_here"])):
        with pytest.raises(ValueError, match=f"train.{field}"):
            verl_ops.check_names(TrainConfig(**{field: value}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="train.kl_type"):
        verl_ops.check_names(TrainConfig(kl_coef=0.1, kl_type="nosuch"))
    verl_ops.check_names(TrainConfig(kl_coef=0.1, kl_type="low_var_kl+", advantage="rloo", policy_loss="gspo"))

    # a user's own estimator, registered in a plugin module, is accepted by name
    (tmp_path / "my_algos.py").write_text(
        "from verl.trainer.ppo import core_algos\n\n\n"
        "@core_algos.register_adv_est('my_estimator_for_tests')\n"
        "def my_estimator(token_level_rewards, response_mask, **kwargs):\n"
        "    return token_level_rewards, token_level_rewards\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    verl_ops.check_names(TrainConfig(plugins=["my_algos"], advantage="my_estimator_for_tests"))


@pytest.mark.parametrize(("setting", "says"), [
    ("advantage=nosuch", "train.advantage: 'nosuch' is not registered with verl"),
    ("workers=4096", "train.workers=4096, but this machine has"),
], ids=["unknown-name", "too-many-workers"])
def test_the_train_command_refuses_bad_settings_before_loading_anything(tmp_path: Path, setting: str,
                                                                        says: str) -> None:
    result = subprocess.run([sys.executable, "-m", "tracetrain.cli", "train", "--db-url", f"sqlite:///{tmp_path}/x.db",
                             "--set", setting], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert says in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "x.db").exists(), "refused before the store was touched"


def test_batches_split_over_workers_by_token_count() -> None:
    lengths = [900, 100, 400, 400, 300, 300, 50]
    shares = balance(lengths, 2)
    loads = sorted(sum(lengths[i] for i in share) for share in shares)
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
    assert loads == [1200, 1250]  # by count it would be 4 vs 3 samples, 1700 vs 750 tokens
    assert balance([10], 3) == [[0], [], []], "fewer samples than workers leaves shares empty"


def test_kept_flat_groups_get_zero_advantage_and_dilute_the_token_mean() -> None:
    """`flat_groups: keep` (TRL's batches): an all-equal group adds no gradient of its own, but its
    tokens join the token-mean's denominator, so the step is the usable groups' gradient scaled by
    their share of the batch's sampled tokens."""
    mixed = [_sample("mixed", 1.0, n_sampled=2), _sample("mixed", 0.0, n_sampled=2)]
    flat = [_sample("flat", 0.0, n_sampled=3), _sample("flat", 0.0, n_sampled=3)]
    cfg = TrainConfig(advantage="rloo", flat_groups="keep")
    assert rl_advantages(mixed + flat, cfg, RunningBaseline(momentum=0.5))[2:] == [0.0, 0.0]

    def gradient(samples: list[Sample]) -> torch.Tensor:
        advantages = rl_advantages(samples, cfg, RunningBaseline(momentum=0.5))
        mb = collate(samples, list(range(len(samples))), pad_id=0)
        logprobs = torch.full(mb.mask.shape, -1.0, requires_grad=True)
        config = verl_ops.actor_config("vanilla", clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                                       loss_agg_mode="token-mean", batch_num_tokens=int(mb.mask.sum()),
                                       global_batch_size=len(samples))
        loss, _ = verl_ops.policy_loss("vanilla", logprobs.detach(), logprobs,
                                       torch.tensor(advantages).unsqueeze(1) * mb.mask, mb.mask, config)
        loss.backward()
        assert logprobs.grad is not None
        return logprobs.grad[:2]

    usable, diluted = gradient(mixed), gradient(mixed + flat)
    assert usable.abs().sum() > 0
    assert torch.allclose(diluted[:, : usable.shape[1]], usable * 4 / 10)  # 4 usable of 10 sampled tokens
