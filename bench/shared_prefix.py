"""Part `shared_prefix` of `bench.trainer_throughput`: one training step on the demo's batches with
`train.shared_prefix` off (every sequence run whole) and on (the beginning every sequence of a pass shares
run once, the rest continuing from its keys and values).

The batches are the demo's (SmolLM2-135M-Instruct, float32, LoRA r16, the demo's training settings):
prompts of the arithmetic agent for training problems drawn from a fixed seed, which all open with the same
instructions and worked examples, and answers of 2 to 9 tokens. Two shapes:

- `groups`: 4 problems x 8 attempts, a step of the demo;
- `singletons`: 32 problems, one attempt each, as a production agent sends them.

Every repetition steps both arms from the same weights and optimizer state, the order rotated, after one
warm-up step each. Besides the time, each repetition records the largest difference between the two arms'
weights after their step, and between their losses: the shortcut must land where the plain pass lands.

    python -m bench.trainer_throughput --parts shared_prefix
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
from typing import Any

import torch
from transformers import AutoTokenizer

from bench.common import Part, ResultTable, console, provenance, run_started
from tracetrain.config import TrainConfig
from tracetrain.demo import arithmetic
from tracetrain.demo.run import DEMO_TRAINING
from tracetrain.engines.models import smollm2_dir
from tracetrain.trainer.checkpoint import build_model
from tracetrain.trainer.data import Sample, collate, pack_samples
from tracetrain.trainer.step import SampledLogits, StepInputs, train_step

SHAPES = {"groups": (4, 8), "singletons": (32, 1)}
"""Problems x attempts per problem of each batch: 32 samples either way."""
ARMS = ("plain", "shared")


def demo_batch(problems: int, attempts: int, seed: int) -> list[Sample]:
    """The demo agent's prompts for `problems` training problems, each with `attempts` answers of random
    tokens (their content does not change the compute) and rewards of 0 or 1."""
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    rng = random.Random(seed)
    samples = []
    for p in range(problems):
        question, _, _ = arithmetic.make_problem(rng)
        prompt = list(tokenizer.apply_chat_template(arithmetic.messages(question), add_generation_prompt=True,
                                                    return_dict=False))
        for a in range(attempts):
            answer = [rng.randrange(200, 20000) for _ in range(rng.randint(2, 9))]
            samples.append(Sample(f"s{p}-{a}", f"g{p}" if attempts > 1 else f"s{p}", prompt + answer,
                                  [0] * len(prompt) + [1] * len(answer), [0.0] * len(prompt) + [-1.5] * len(answer),
                                  [0] * (len(prompt) + len(answer)), float(rng.random() < 0.4)))
    return samples


def _tokens(samples: list[Sample], cfg: TrainConfig) -> int:
    """Positions the passes compute: every row whole, or each micro-batch's shared beginning once."""
    total = 0
    for batch in pack_samples(samples, list(range(len(samples))), cfg.micro_batch_tokens,
                              shared_prefix=cfg.shared_prefix):
        micro = collate(samples, batch, pad_id=0)
        rows, width = micro.input_ids.shape
        shared = micro.shared if cfg.shared_prefix else 0
        total += shared + rows * (width - shared)
    return total


def _step(start: SampledLogits, optimizer_state: dict[str, Any], samples: list[Sample], cfg: TrainConfig,
          pad: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    policy = copy.deepcopy(start)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    optimizer.load_state_dict(optimizer_state)
    advantages = [s.reward - statistics.fmean(x.reward for x in samples) for s in samples]
    figures = train_step(policy, optimizer, StepInputs(samples, advantages), cfg, pad)
    return figures, {n: p.detach() for n, p in policy.named_parameters() if p.requires_grad}


def measure(repetitions: int) -> dict[str, Any]:
    base = TrainConfig.model_validate(DEMO_TRAINING)
    configs = {arm: base.model_copy(update={"shared_prefix": arm == "shared"}) for arm in ARMS}
    torch.manual_seed(0)
    start = SampledLogits(build_model(smollm2_dir(), base))
    with torch.no_grad():  # an adapter some steps in, so every LoRA weight has a gradient
        for name, param in start.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.01)
    empty = torch.optim.AdamW([p for p in start.parameters() if p.requires_grad], lr=base.lr, fused=True)
    optimizer_state = copy.deepcopy(empty.state_dict())
    pad = int(getattr(start.model.config, "eos_token_id", None) or 0)
    runs: list[dict[str, Any]] = []
    for shape, (problems, attempts) in SHAPES.items():
        samples = demo_batch(problems, attempts, seed=0)
        for arm in ARMS:  # warm-up: allocators and kernels
            _step(start, optimizer_state, samples, configs[arm], pad)
        for rep in range(repetitions):
            order = ARMS if rep % 2 == 0 else ARMS[::-1]
            results = {arm: _step(start, optimizer_state, samples, configs[arm], pad) for arm in order}
            (plain, plain_weights), (shared, shared_weights) = results["plain"], results["shared"]
            drift = max(float((shared_weights[n] - w).abs().max()) for n, w in plain_weights.items())
            moved = max(float((w - start.get_parameter(n).detach()).abs().max()) for n, w in plain_weights.items())
            for arm in ARMS:
                figures = results[arm][0]
                runs.append({"shape": shape, "arm": arm, "repetition": rep,
                             "forward_backward_s": figures["forward_backward_seconds"],
                             "step_s": figures["step_seconds"], "micro_batches": figures["micro_batches"],
                             "loss": figures["loss"], "tokens_computed": _tokens(samples, configs[arm]),
                             "weights_max_diff": drift, "weights_max_step": moved})
            console.print(f"  {shape:<10} rep {rep}: plain {plain['step_seconds']:5.2f} s, shared "
                          f"{shared['step_seconds']:5.2f} s; weights differ by at most {drift:.1e} "
                          f"(the step moved them by up to {moved:.1e})", highlight=False)
    return {"runs": runs, "repetitions": repetitions}


def _spread(values: list[float], fmt: str) -> str:
    return f"{statistics.fmean(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def tables(raw: dict[str, Any]) -> list[ResultTable]:
    table = ResultTable(f"one training step of 32 samples, mean (min-max) over {raw['repetitions']} repetitions",
                        ["batch", "arm", "tokens computed", "micro-batches", "forward/backward s", "step s",
                         "step vs plain", "largest weight difference", "largest weight change",
                         "largest loss difference"], right_align_from=2)
    for shape in SHAPES:
        mine = [r for r in raw["runs"] if r["shape"] == shape]
        plain = {r["repetition"]: r for r in mine if r["arm"] == "plain"}
        for arm in ARMS:
            rows = [r for r in mine if r["arm"] == arm]
            ratios = [r["step_s"] / plain[r["repetition"]]["step_s"] for r in rows]
            losses = [abs(r["loss"] - plain[r["repetition"]]["loss"]) for r in rows]
            plain_arm = arm == "plain"
            table.add(shape, arm, str(rows[0]["tokens_computed"]), str(rows[0]["micro_batches"]),
                      _spread([r["forward_backward_s"] for r in rows], ".2f"),
                      _spread([r["step_s"] for r in rows], ".2f"), _spread(ratios, ".2f") + "x",
                      "-" if plain_arm else f"{max(r['weights_max_diff'] for r in rows):.1e}",
                      f"{max(r['weights_max_step'] for r in rows):.1e}", "-" if plain_arm else f"{max(losses):.1e}")
    return [table]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shared-repetitions", type=int, default=5, help="shared_prefix part: repetitions")


def part(args: argparse.Namespace, command: str) -> Part:
    started = run_started()
    console.print(f"shared_prefix: the demo's batches, {args.shared_repetitions} repetitions")
    raw = measure(args.shared_repetitions)
    cfg = TrainConfig.model_validate(DEMO_TRAINING)
    notes = [
        f"The demo's training settings (LoRA r{cfg.lora_rank}, micro-batches of up to {cfg.micro_batch_tokens} "
        f"tokens computed, {cfg.advantage} advantages, {cfg.policy_loss} policy loss), "
        f"{torch.get_num_threads()} torch threads; the step's time as the trainer reports it (forward/backward "
        "and the optimizer).",
        "tokens computed: positions the passes run, summed over the step's micro-batches (padding included); "
        "with the shared prefix a micro-batch's common beginning counts once, so more samples fit one pass.",
        "largest weight difference: between the two arms' trainable weights after the step (the adapter), "
        "beside the largest change the step made to any of them.",
        "Every prompt opens with the same instructions and worked examples (65 tokens), which is what a pass "
        "shares when it holds several problems, in both batches. A group's 8 attempts also share their question, "
        "which a pass computes once only when it holds that group alone.",
    ]
    return Part("shared_prefix", command, provenance(started), tables(raw), notes, raw)
