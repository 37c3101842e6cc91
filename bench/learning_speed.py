"""Learning speed: tracetrain against TRL's GRPOTrainer, held-out reward against wall-clock time.

Same model (SmolLM2-135M-Instruct, float32), task, prompts, reward and machine, one arm after the other
(never both at once), each for the same wall-clock budget counted from the moment the arm starts, so
start-up (vLLM + gateway for tracetrain, imports + model load for TRL) is on the clock.

- tracetrain: `tracetrain serve --train` with the demo's trainer settings (`DEMO_TRAINING`), the unmodified
  arithmetic agent (examples/agents/arithmetic) generating through the gateway and posting rewards.
- TRL: `trl.GRPOTrainer` with a LoRA `peft_config`, HF `generate` on the CPU (TRL's default, no vLLM),
  settings matched to the demo's (group of 8, 32 completions per step, LoRA r16/a32, lr 2e-4 constant,
  no KL, token-mean loss, grad clip 1, fp32, no gradient checkpointing).

`--eval-every` seconds after the previous one ended, both arms run the same held-out evaluation: the
agent's `--eval` problems (seed 10000 + seed), greedy, 12 tokens, scored by the agent's `score`. For
tracetrain that is the agent's own `--eval` mode through the gateway while training traffic continues;
TRL pauses between steps. A point is plotted when its evaluation finished, and evaluation time is on the
wall clock of both arms. Results: `bench/results/<output>.{md,png,json}`.

    python -m bench.learning_speed --minutes 20
    python -m bench.learning_speed --minutes 3 --eval-size 16 --eval-every 60   # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from bench.common import OUT_DIR, RESULTS_DIR, ResultTable, console, free_port, write_results
from tracetrain.config import TrainConfig
from tracetrain.demo import AGENT, DEMO_TRAINING, _wait_healthy, _write_config
from tracetrain.engines.vllm_server import die_with_parent

MAX_TOKENS = 12
"""The agent's `max_tokens` (examples/agents/arithmetic/agent.py `attempt`)."""
DEMO = TrainConfig.model_validate(DEMO_TRAINING)
"""The demo's trainer settings, typed."""
GROUP_SIZE = 8
"""The agent's default `--group-size`."""
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""The modules tracetrain's trainer puts LoRA on (tracetrain/trainer/checkpoint.py)."""
TRL_LOSS_TYPE = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}
"""tracetrain's (verl's) loss aggregation -> TRL's loss_type with the same normalisation."""


@dataclass
class EvalPoint:
    t: float
    """Wall-clock seconds since the arm started, when this evaluation finished: the policy it measured
    existed by then (for tracetrain a new version may start serving during an evaluation)."""
    reward: float
    exact: float
    version: int
    """tracetrain: highest policy version that answered; TRL: optimizer steps taken."""
    seconds: float
    """How long the evaluation itself took (on the clock too)."""
    episodes: int
    """Training completions generated so far."""


@dataclass
class ArmResult:
    name: str
    startup_s: float
    points: list[EvalPoint] = field(default_factory=list)
    steps: int = 0
    episodes: int = 0
    total_s: float = 0.0
    load: float = 0.0
    """1-minute load average just before the arm started: other work on the machine."""

    @property
    def final(self) -> float:
        return self.points[-1].reward

    def reaches(self, target: float) -> EvalPoint | None:
        return next((p for p in self.points if p.reward >= target - 1e-9), None)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ArmResult:
        return cls(**{**data, "points": [EvalPoint(**p) for p in data["points"]]})


def load_agent() -> ModuleType:
    """The arithmetic agent as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("arithmetic_agent", AGENT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- tracetrain arm -------------------------------------------------------------------------------


def _gateway_eval(url: str, n: int, seed: int, out: Path) -> dict[str, Any]:
    subprocess.run([sys.executable, str(AGENT), "--gateway", url, "--eval", str(n), "--seed", str(seed),
                    "--out", str(out)], check=True, capture_output=True, text=True)
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def _trained_steps(url: str) -> int:
    """Highest policy version the trainer has produced (version 0, the base model, is listed too)."""
    try:
        return max((int(p["version"]) for p in httpx.get(f"{url}/v1/policies", timeout=10).json()["data"]), default=0)
    except (httpx.HTTPError, KeyError, ValueError):
        return -1


def _count_lines(path: Path) -> int:
    try:
        with path.open() as f:
            return sum(1 for line in f if line.startswith("{"))
    except OSError:
        return 0


def _stop(process: subprocess.Popen[bytes], grace: float = 60.0) -> None:
    """SIGTERM to the gateway's process group (it stops its vLLM child itself), SIGKILL after `grace`."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run_tracetrain(args: argparse.Namespace, out: Path) -> ArmResult:
    shutil.rmtree(out, ignore_errors=True)  # a leftover store or checkpoint would resume an old policy
    out.mkdir(parents=True)
    port, vllm_port = args.port or free_port(), args.vllm_port or free_port()
    config = _write_config(out, port, vllm_port, args.engine, {})
    url = f"http://127.0.0.1:{port}"
    log = out / "gateway.log"
    started = time.monotonic()
    budget = args.minutes * 60

    def clock() -> float:
        return time.monotonic() - started

    console.print(f"[bold]tracetrain[/bold]: serve --train ({config}), logs {log}")
    gateway = subprocess.Popen([sys.executable, "-m", "tracetrain.cli", "--config", str(config), "serve", "--train"],
                               stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=die_with_parent)
    agent: subprocess.Popen[bytes] | None = None
    episodes_log = out / "episodes.jsonl"
    try:
        _wait_healthy(url, gateway, log)
        result = ArmResult("tracetrain", startup_s=clock())
        console.print(f"  up after {result.startup_s:.0f}s")

        def evaluate() -> None:
            began = clock()
            summary = _gateway_eval(url, args.eval_size, args.seed, out / f"eval_{len(result.points):03d}.json")
            point = EvalPoint(t=clock(), reward=summary["mean_reward"], exact=summary["exact"],
                              version=max(summary["versions"]), seconds=clock() - began,
                              episodes=_count_lines(episodes_log))
            result.points.append(point)
            console.print(f"  [tracetrain] {point.t / 60:5.1f} min  eval reward {point.reward:.3f}  exact "
                          f"{point.exact:5.1%}  policy v{point.version} (answered by {summary['versions']})  "
                          f"{point.episodes} episodes  trained steps {_trained_steps(url)}  eval {point.seconds:.0f}s")

        evaluate()
        remaining = budget - clock()
        if remaining <= 0:
            console.print(f"  [yellow]start-up used the whole {args.minutes} min budget: no training[/yellow]")
        else:
            cmd = [sys.executable, str(AGENT), "--gateway", url, "--minutes", f"{remaining / 60:.4f}",
                   "--seed", str(args.seed), "--log"]
            agent = subprocess.Popen(cmd, stdout=episodes_log.open("wb"), stderr=(out / "agent.log").open("wb"),
                                     preexec_fn=die_with_parent)
            while agent.poll() is None:
                wait = result.points[-1].t + args.eval_every - clock()
                if wait > 0:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        agent.wait(timeout=wait)
                    continue
                if budget - clock() > args.eval_every / 3:  # else the final evaluation follows shortly
                    evaluate()
                else:
                    agent.wait()
            if agent.returncode != 0:
                raise SystemExit(f"the agent failed:\n{(out / 'agent.log').read_text()[-3000:]}")
        evaluate()
        result.steps = _trained_steps(url)
        result.episodes = _count_lines(episodes_log)
        result.total_s = clock()
        return result
    finally:
        if agent is not None and agent.poll() is None:
            agent.terminate()
            agent.wait()
        _stop(gateway)


# --- TRL arm ----------------------------------------------------------------------------------------


def run_trl(args: argparse.Namespace, out: Path) -> ArmResult:
    """The TRL arm in a fresh process (imports and model load on its clock), relaying its progress."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    result_path, log = out / "result.json", out / "trl.log"
    console.print(f"[bold]TRL[/bold]: GRPOTrainer in a child process, logs {log}")
    cmd = [sys.executable, "-m", "bench.learning_speed", "--trl-worker", str(result_path), "--t0", repr(time.time()),
           "--minutes", str(args.minutes), "--eval-every", str(args.eval_every), "--eval-size", str(args.eval_size),
           "--seed", str(args.seed)]
    with log.open("wb") as stderr:
        worker = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, preexec_fn=die_with_parent,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
        assert worker.stdout is not None
        try:
            for line in worker.stdout:
                console.print(f"  [TRL] {line.rstrip()}", highlight=False)
            worker.wait()
        finally:
            if worker.poll() is None:
                worker.terminate()
                worker.wait()
    if worker.returncode != 0:
        raise SystemExit(f"the TRL arm failed ({worker.returncode}):\n{log.read_text()[-4000:]}")
    return ArmResult.from_json(json.loads(result_path.read_text()))


def trl_worker(args: argparse.Namespace) -> None:
    """Runs in the child process. Everything from here is on the arm's clock (t0 was taken by the parent)."""

    def clock() -> float:
        return time.time() - args.t0

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from tracetrain.engines.models import smollm2_dir

    agent = load_agent()
    model_dir = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)

    rng = random.Random(args.seed)  # the agent's training stream: one problem per group, in order
    prompts_needed = int(args.minutes * 60) * GROUP_SIZE + 64  # far more than a CPU gets through
    problems = [agent.make_problem(rng) for _ in range(prompts_needed // GROUP_SIZE)]
    dataset = Dataset.from_list([{"prompt": agent.messages(q), "answer": a} for q, a, _ in problems])
    held_rng = random.Random(10_000 + args.seed)  # the agent's `evaluate`
    held_out = [agent.make_problem(held_rng) for _ in range(args.eval_size)]

    def arithmetic_reward(completions: list[list[dict[str, str]]], answer: list[int], **_: Any) -> list[float | None]:
        return [agent.score(c[-1]["content"], a) for c, a in zip(completions, answer, strict=True)]

    if DEMO.algorithm != "rl" or DEMO.advantage != "grpo" or DEMO.policy_loss != "vanilla" or not DEMO.lora \
            or DEMO.loss_agg_mode not in TRL_LOSS_TYPE:
        raise SystemExit(f"DEMO_TRAINING changed ({DEMO_TRAINING}): map it to GRPOConfig in bench/learning_speed.py")
    batch = DEMO.batch_sessions  # 32 completions (4 groups of 8) per optimizer step
    config = GRPOConfig(
        output_dir=str(Path(args.trl_worker).parent / "trainer"),
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_generations=GROUP_SIZE,
        max_completion_length=MAX_TOKENS, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=DEMO.lr, lr_scheduler_type="constant", weight_decay=DEMO.weight_decay,
        max_grad_norm=DEMO.grad_clip, optim="adamw_torch", beta=DEMO.kl_coef, epsilon=DEMO.clip_ratio,
        num_iterations=DEMO.ppo_epochs, loss_type=TRL_LOSS_TYPE[DEMO.loss_agg_mode], scale_rewards="group",
        max_steps=len(problems) * GROUP_SIZE // batch, shuffle_dataset=False, seed=args.seed,
        bf16=False, gradient_checkpointing=False, use_cpu=True,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
    )
    peft_config = LoraConfig(r=DEMO.lora_rank, lora_alpha=DEMO.lora_alpha, lora_dropout=0.0,
                             task_type="CAUSAL_LM", target_modules=LORA_TARGETS)
    greedy = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    result = ArmResult("TRL GRPOTrainer", startup_s=0.0)
    budget, every = args.minutes * 60, args.eval_every
    step_started = [time.time()]

    @torch.no_grad()
    def evaluate(policy: Any, step: int) -> None:
        began = clock()
        was_training = policy.training
        policy.eval()
        rewards: list[float] = []
        for i in range(0, len(held_out), 32):
            chunk = held_out[i:i + 32]
            texts = [tokenizer.apply_chat_template(agent.messages(q), add_generation_prompt=True, tokenize=False)
                     for q, _, _ in chunk]
            inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
            generated = policy.generate(**inputs, generation_config=greedy)
            replies = tokenizer.batch_decode(generated[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            rewards += [agent.score(r, a) for r, (_, a, _) in zip(replies, chunk, strict=True)]
        policy.train(was_training)
        point = EvalPoint(t=clock(), reward=sum(rewards) / len(rewards), version=step, seconds=clock() - began,
                          exact=sum(r == 1.0 for r in rewards) / len(rewards), episodes=step * batch)
        result.points.append(point)
        print(f"{point.t / 60:5.1f} min  eval reward {point.reward:.3f}  exact {point.exact:5.1%}  step {step}  "
              f"{point.episodes} episodes  eval {point.seconds:.0f}s", flush=True)

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_started[0] = time.time()

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            logs = kwargs.get("logs") or {}
            if "reward" in logs:
                print(f"{clock() / 60:5.1f} min  step {state.global_step}  train reward {logs['reward']:.3f}  "
                      f"({time.time() - step_started[0]:.1f} s/step)", flush=True)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if clock() >= budget:
                control.should_training_stop = True
            elif clock() - result.points[-1].t >= every and budget - clock() > every / 3:
                evaluate(trainer.model, state.global_step)

    trainer = GRPOTrainer(model=model, reward_funcs=[arithmetic_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)  # its raw log dicts would drown the progress lines
    result.startup_s = clock()
    print(f"trainer ready after {result.startup_s:.0f}s (trl {_trl_version()}, "
          f"torch threads {torch.get_num_threads()})", flush=True)
    evaluate(trainer.model, 0)
    trainer.train()
    evaluate(trainer.model, trainer.state.global_step)
    result.steps = trainer.state.global_step
    result.episodes = result.steps * batch
    result.total_s = clock()
    Path(args.trl_worker).write_text(json.dumps(asdict(result)))


# --- report -----------------------------------------------------------------------------------------


def _reach(arm: ArmResult, target: float) -> str:
    point = arm.reaches(target)
    return f"{point.t / 60:.1f} min" if point else "not reached"


def report(args: argparse.Namespace, arms: list[ArmResult], name: str) -> None:
    curve = ResultTable("held-out eval reward against wall-clock (minutes: when the evaluation finished)",
                        ["arm", "minutes", "eval reward", "exact", "version / step", "train episodes", "eval s"])
    for arm in arms:
        for p in arm.points:
            curve.add(arm.name, f"{p.t / 60:.1f}", f"{p.reward:.3f}", f"{p.exact:.1%}", p.version, p.episodes,
                      f"{p.seconds:.0f}")
    trl = next((a for a in arms if a.name.startswith("TRL")), None)
    target = trl.final if trl else None
    summary = ResultTable("summary", ["arm", "load avg", "start-up s", "optimizer steps", "train episodes",
                                      "eval s total", "first eval", "final eval",
                                      f"reaches TRL final ({target:.3f})" if target is not None else "reaches TRL"])
    for arm in arms:
        summary.add(arm.name, f"{arm.load:.1f}", f"{arm.startup_s:.0f}", arm.steps, arm.episodes,
                    f"{sum(p.seconds for p in arm.points):.0f}", f"{arm.points[0].reward:.3f}", f"{arm.final:.3f}",
                    _reach(arm, target) if target is not None else "-")
    console.print(curve.rich())
    console.print(summary.rich())
    verdict = None
    tt = next((a for a in arms if a.name == "tracetrain"), None)
    if trl and tt and target is not None:
        mine, theirs = tt.reaches(target), trl.reaches(target)
        met = mine is not None and (theirs is None or mine.t < theirs.t)
        verdict = (f"target (tracetrain reaches TRL's final eval reward {target:.3f} in less time): "
                   f"{'met' if met else 'NOT met'}; tracetrain {_reach(tt, target)}, TRL {_reach(trl, target)}")
        console.print(("[green]" if met else "[red]") + verdict)
    plot = RESULTS_DIR / f"{name}.png"
    _plot(args, arms, target, plot)
    raw = RESULTS_DIR / f"{name}.json"
    raw.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("trl_worker", "t0")},
                               "arms": [asdict(a) for a in arms]}, indent=1))
    notes = [
        *([verdict] if verdict else []),
        f"each arm: {args.minutes:g} min wall-clock from its start (start-up included), then a final evaluation; "
        f"held-out evaluation of {args.eval_size} sums (greedy, {MAX_TOKENS} tokens) {args.eval_every:g} s after the "
        "previous one ended, each point timed when its evaluation finished; "
        "the arms ran one after the other, never together",
        f"tracetrain: `serve --train` with tracetrain/demo.py DEMO_TRAINING ({DEMO.advantage} advantages, "
        f"{DEMO.policy_loss} PPO-clip loss, {DEMO.loss_agg_mode}, LoRA r{DEMO.lora_rank}/alpha{DEMO.lora_alpha} on "
        f"all linear layers, lr {DEMO.lr:g}, {DEMO.batch_sessions} sessions per step, mode {DEMO.mode}, max "
        f"staleness {DEMO.max_staleness}, TIS cap {DEMO.tis_cap}), vLLM on CPU generating, the unmodified "
        "arithmetic agent (group of 8, temperature 1, 12 tokens); its evaluations go through the gateway like "
        "the training traffic ('version' is the highest policy version that answered)",
        f"TRL {_trl_version()}: GRPOTrainer with the same prompts in the same order (shuffle off), the agent's score "
        f"on the completion text, 8 generations per prompt, {DEMO.batch_sessions} completions per optimizer step, "
        f"LoRA via peft_config (same rank, alpha, modules, no dropout), lr {DEMO.lr:g} constant, AdamW, grad clip "
        f"{DEMO.grad_clip:g}, beta {DEMO.kl_coef:g}, epsilon {DEMO.clip_ratio:g}, loss_type "
        f"{TRL_LOSS_TYPE.get(DEMO.loss_agg_mode)} (= {DEMO.loss_agg_mode}), fp32 (TRL's default bf16 off), no "
        "gradient checkpointing (TRL's default on: slower), HF generate on CPU (no vLLM); evaluations pause "
        "training between steps ('version' is the step)",
        "known differences: TRL is synchronous and on-policy with exactly "
        f"{DEMO.batch_sessions} completions per step; tracetrain "
        + ("(sync) pauses generation, evaluations included, while a batch trains and steps on every finished "
           f"session (at least {DEMO.min_sessions}), so a step may see more" if DEMO.mode == "sync" else
           f"trains while generating, on samples up to {DEMO.max_staleness} version(s) old")
        + "; it drops zero-variance groups before the token-mean (TRL keeps them in the denominator) "
        "and corrects vLLM-vs-trainer logprob mismatch with truncated importance sampling; greedy evaluation runs "
        "in vLLM for tracetrain and in HF generate for TRL (same weights, small numeric differences)",
        "the budget is checked between TRL steps, so TRL's last step may end past it; the agent starts no new "
        "group after it",
        "numbers depend on the machine and on what else runs on it (load avg: 1-minute load just before the arm "
        "started; with 2 CPUs anything near 1 or above is other work competing); compare the arms of one run",
    ]
    path = write_results(name, "Learning speed: tracetrain vs TRL GRPOTrainer", _command(), [summary, curve],
                         notes + [f"plot: `{plot.relative_to(RESULTS_DIR.parent.parent)}`, raw points: "
                                  f"`{raw.relative_to(RESULTS_DIR.parent.parent)}`"])
    console.print(f"results: {path}, {plot}, {raw}")


def _trl_version() -> str:
    try:
        from importlib.metadata import version

        return version("trl")
    except Exception:
        return "?"


def _command() -> str:
    return "python -m bench.learning_speed " + " ".join(sys.argv[1:])


def _plot(args: argparse.Namespace, arms: list[ArmResult], target: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for arm, color in zip(arms, ("tab:green", "tab:blue"), strict=False):
        ax.plot([p.t / 60 for p in arm.points], [p.reward for p in arm.points], marker="o", color=color,
                drawstyle="steps-post", label=f"{arm.name} (up after {arm.startup_s:.0f} s, {arm.steps} steps)")
        ax.axvline(arm.startup_s / 60, color=color, alpha=0.25, linestyle=":")
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", label=f"TRL final eval reward {target:.3f}")
    ax.axvline(args.minutes, color="black", alpha=0.4, linestyle="-.", label=f"budget {args.minutes:g} min")
    ax.set_xlabel("wall-clock minutes since the arm started (start-up and evaluations included; dotted: up)")
    ax.set_ylabel(f"held-out eval reward ({args.eval_size} sums, greedy)")
    ax.set_title("SmolLM2-135M-Instruct learning arithmetic on this CPU: tracetrain vs TRL GRPOTrainer")
    ax.legend(loc="best", fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.learning_speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0, help="wall-clock budget per arm, start-up included")
    parser.add_argument("--eval-every", type=float, default=90.0,
                        help="seconds from the end of one held-out evaluation to the next")
    parser.add_argument("--eval-size", type=int, default=64, help="held-out problems per evaluation")
    parser.add_argument("--arms", default="tracetrain,trl", help="which arms, in this order (tracetrain, trl)")
    parser.add_argument("--seed", type=int, default=0, help="agent seed: training stream and held-out set")
    parser.add_argument("--engine", default="auto", choices=["auto", "vllm", "transformers"],
                        help="tracetrain's engine (auto: vLLM when installed)")
    parser.add_argument("--port", type=int, default=0, help="gateway port (0: a free one)")
    parser.add_argument("--vllm-port", type=int, default=0, help="vLLM port (0: a free one)")
    parser.add_argument("--output", default="learning_speed", help="results name under bench/results/")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        trl_worker(args)
        return
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(arms) - {"tracetrain", "trl"}
    if unknown:
        parser.error(f"unknown arms: {sorted(unknown)}")
    out = OUT_DIR / "learning_speed"
    console.rule(f"learning speed: {args.minutes:g} min per arm, eval {args.eval_size} sums every {args.eval_every:g}s")
    results = []
    for arm in arms:
        runner = run_tracetrain if arm == "tracetrain" else run_trl
        load = os.getloadavg()[0]
        results.append(runner(args, out / arm))
        results[-1].load = load
    report(args, results, args.output)


if __name__ == "__main__":
    main()
