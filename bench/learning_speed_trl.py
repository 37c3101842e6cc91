"""The TRL arm of `bench/learning_speed.py`, run as its own process so imports and model load are on its clock:

    python -m bench.learning_speed_trl SPEC.json     # started by bench.learning_speed, not by hand

`trl.GRPOTrainer` with a LoRA `peft_config` and HF `generate` on the CPU, every setting taken from the
constants of `bench.learning_speed` (the same ones the tracetrain arms use). It writes an `ArmRun` as JSON
to the path the spec names and prints one progress line per step and per evaluation.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.learning_speed import (
    BATCH,
    DEMO,
    DEMO_TRAINING,
    GROUP_SIZE,
    LORA_TARGETS,
    MAX_TOKENS,
    TEMPERATURE,
    TRL_LOSS_TYPE,
    TRL_SCALE_REWARDS,
    RunSpec,
)
from bench.learning_speed_report import ArmClock, ArmRun, EvalPoint
from tracetrain.demo import arithmetic


def trl_worker(spec_path: Path) -> None:
    """Runs in the child process; its clock started in the parent, before this process existed."""
    raw = json.loads(spec_path.read_text())
    t0, result_path = raw.pop("t0"), Path(raw.pop("result"))
    spec = RunSpec(**raw)
    clock = ArmClock(t0)  # started in the parent; evaluations are off it

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from tracetrain.engines.models import smollm2_dir

    if DEMO.algorithm != "rl" or DEMO.advantage not in TRL_SCALE_REWARDS or DEMO.policy_loss != "vanilla" \
            or not DEMO.lora or DEMO.loss_agg_mode not in TRL_LOSS_TYPE:
        raise SystemExit(f"DEMO_TRAINING changed ({DEMO_TRAINING}): map it to GRPOConfig in bench/learning_speed.py")
    model_dir = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rng = random.Random(spec.seed)  # the agent's training stream: one problem per group, in order
    problems = [arithmetic.make_problem(rng) for _ in range(max(64, int(spec.minutes * 60)))]  # more than a CPU uses
    dataset = Dataset.from_list([{"prompt": arithmetic.messages(q), "answer": a} for q, a, _ in problems])
    held = arithmetic.held_out(spec.eval_size, spec.split)

    def arithmetic_reward(completions: list[list[dict[str, str]]], answer: list[int], **_: Any) -> list[float | None]:
        return [arithmetic.score(c[-1]["content"], a) for c, a in zip(completions, answer, strict=True)]

    config = GRPOConfig(
        output_dir=str(result_path.parent / "trainer"),
        per_device_train_batch_size=BATCH, gradient_accumulation_steps=1, num_generations=GROUP_SIZE,
        max_completion_length=MAX_TOKENS, temperature=TEMPERATURE, top_p=1.0, top_k=0,
        learning_rate=spec.lr, lr_scheduler_type="constant", weight_decay=DEMO.weight_decay,
        max_grad_norm=DEMO.grad_clip, optim="adamw_torch_fused", beta=DEMO.kl_coef, epsilon=DEMO.clip_ratio,
        num_iterations=DEMO.ppo_epochs, loss_type=TRL_LOSS_TYPE[DEMO.loss_agg_mode],
        scale_rewards=TRL_SCALE_REWARDS[DEMO.advantage],
        max_steps=len(problems) * GROUP_SIZE // BATCH, shuffle_dataset=False, seed=spec.seed,
        bf16=False, gradient_checkpointing=False, use_cpu=True,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
    )
    peft_config = LoraConfig(r=DEMO.lora_rank, lora_alpha=DEMO.lora_alpha, lora_dropout=0.0,
                             task_type="CAUSAL_LM", target_modules=LORA_TARGETS)
    greedy = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    run = ArmRun(spec.arm, spec.seed, spec.lr, spec.split, spec.minutes * 60, spec.order)
    step_started = [time.time()]

    @torch.no_grad()
    def evaluate(policy: Any, step: int) -> None:
        began = time.time()
        was_training = policy.training
        policy.eval()
        rewards: list[float] = []
        with clock.paused():
            for i in range(0, len(held), 32):
                chunk = held[i:i + 32]
                texts = [tokenizer.apply_chat_template(arithmetic.messages(q), add_generation_prompt=True,
                                                       tokenize=False) for q, _ in chunk]
                inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                                   add_special_tokens=False)
                generated = policy.generate(**inputs, generation_config=greedy)
                replies = tokenizer.batch_decode(generated[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
                rewards += [arithmetic.score(r, a) for r, (_, a) in zip(replies, chunk, strict=True)]
        policy.train(was_training)
        point = EvalPoint(t=clock(), reward=sum(rewards) / len(rewards), step=step, seconds=time.time() - began,
                          exact=sum(r == 1.0 for r in rewards) / len(rewards), episodes=step * BATCH, versions=[step])
        run.points.append(point)
        training = max(clock() - run.startup_s, 1e-9)
        print(f"{point.t / 60:5.1f} min  {spec.split} reward {point.reward:.3f}  exact {point.exact:5.1%}  step {step} "
              f"({step / training * 60:.2f} steps/min)  {point.episodes} episodes ({point.episodes / training:.2f}/s)"
              f"  eval {point.seconds:.0f}s", flush=True)

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            optimizer = getattr(kwargs.get("optimizer"), "optimizer", kwargs.get("optimizer"))
            if optimizer is not None:
                run.optimizer = f"{type(optimizer).__name__}(fused={optimizer.defaults.get('fused')})"

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_started[0] = time.time()

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            logs = kwargs.get("logs") or {}
            if "reward" in logs:
                print(f"{clock() / 60:5.1f} min  step {state.global_step}  train reward {logs['reward']:.3f}  "
                      f"({time.time() - step_started[0]:.1f} s/step)", flush=True)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if clock() >= run.budget_s:
                control.should_training_stop = True
            elif clock() - run.points[-1].t >= spec.eval_every and run.budget_s - clock() > spec.eval_every / 3:
                evaluate(trainer.model, state.global_step)

    trainer = GRPOTrainer(model=model, reward_funcs=[arithmetic_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)  # its raw log dicts would drown the progress lines
    run.startup_s = clock()
    print(f"trainer ready after {run.startup_s:.0f}s (torch threads {torch.get_num_threads()})", flush=True)
    evaluate(trainer.model, 0)
    if clock() < run.budget_s:
        trainer.train()
    print(f"optimizer: {run.optimizer}", flush=True)
    run.train_end_s = clock()
    evaluate(trainer.model, trainer.state.global_step)
    run.steps = trainer.state.global_step
    run.episodes = run.steps * BATCH
    run.step_samples = [BATCH] * run.steps
    run.samples_per_step = run.sessions_per_step = float(BATCH)
    run.total_s = clock()
    result_path.write_text(json.dumps(asdict(run)))


if __name__ == "__main__":
    trl_worker(Path(sys.argv[1]))
