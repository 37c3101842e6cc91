"""One configuration object, from (lowest to highest precedence) defaults, a YAML file,
`TRACETRAIN_…` environment variables and command-line flags. Its settings are grouped by concern: `engine`,
`store`, `gateway`, `train` and `promotion` (`engine.urls` in YAML is `engine: {urls: […]}`, in the
environment `TRACETRAIN_ENGINE__URLS`, on the command line `--set engine.urls=…`)."""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import os
import re
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

if TYPE_CHECKING:
    from tracetrain.engines.gpus import GPUPlan

log = logging.getLogger(__name__)


class TrainConfig(BaseModel):
    """The learning loop. Algorithm names come from verl's registries (your own registered ones too)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)  # a docstring is its description

    plugins: list[str] = Field(default_factory=list)
    """Modules imported before the trainer starts: register your own verl estimators and losses there
    (`core_algos.register_adv_est`, `register_policy_loss`)."""
    algorithm: Literal["rl", "sft", "dpo"] = "rl"
    """`rl`: advantages + policy loss; `sft`: imitate trajectories with reward >= sft_min_reward;
    `dpo`: best vs worst of each group."""
    advantage: str = "rloo"
    """verl advantage estimator: rloo, grpo, reinforce_plus_plus, remax, ... Groups of one always use
    the running baseline. rloo by default: grpo divides by each group's reward spread, which turns tiny
    differences among all-wrong answers into full-size advantages (bench/results/demo_seeds_grpo.md,
    in git history at af20f58)."""
    policy_loss: str = "vanilla"
    """verl policy loss: vanilla (PPO-clip), gspo, cispo, sapo, clip_cov, ... or a registered one."""
    loss_agg_mode: str = "token-mean"
    """verl aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm."""
    clip_ratio: float = 0.2
    """PPO clip range (and the default for clip_ratio_low/high)."""
    clip_ratio_low: float | None = None
    """Lower clip range; None uses clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip range (DAPO's clip-higher); None uses clip_ratio."""
    ppo_epochs: int = 1
    """Passes over each batch; with more than one, PPO clipping against the step's start matters."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) model; 0 skips the reference forward."""
    kl_type: str = "low_var_kl"
    """verl kl_penalty kind: kl (k1), abs, mse (k2), low_var_kl (k3), and '+' variants."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    tis_cap: float | None = 2.0
    """Truncated importance sampling cap against behaviour logprobs; None disables the correction."""
    mode: Literal["sync", "async"] = "async"
    """`sync`: generation waits while a batch trains (on-policy); `async`: it does not."""
    max_staleness: int = 1
    """Sessions with a call more than this many versions older than the trainer's are set aside as
    `stale` (kept in the store, counted, never trained on by this loop). Rewards that come minutes late
    need a bound that covers their lag in versions (docs/architecture.md, "Late rewards")."""
    batch_sessions: int = 32
    """Usable sessions per training step: whole groups, freshest first (so up to one group more when
    group sizes do not add up to it); with `flat_groups: set_aside`, zero-variance groups are replaced by
    more groups (DAPO's dynamic sampling)."""
    flat_groups: Literal["set_aside", "baseline", "keep"] = "baseline"
    """Groups whose rewards are all equal (all failed, or all succeeded), under a group estimator.
    `baseline` (the default): trained against the running baseline, so an all-fail group pushes away from
    what failed and a rare all-success group pays fully. `set_aside`: replaced by more groups (DAPO's
    dynamic sampling); on a hard task that discards most of what the agents generate, and the trainer
    waits for the groups that replace them. `keep`: trained on with the group estimator's zero advantage,
    as TRL and verl do without dynamic sampling: they add no gradient, but their tokens count in the
    token-mean, so steps shrink as more groups agree. The default was chosen on the validation split with
    every other setting at its default (bench/results/learning_arms_validation.md, `hard+defaults`)."""
    replay_successes: int = Field(default=0, ge=0)
    """Earlier samples that did better than expected trained on again, up to this many per step, while
    their reward is still above their group's running baseline (self-imitation, Oh et al. 2018:
    trainer/algorithms/replay.py). Rare successes on a hard task then pay more than once. 0: off."""
    replay_max_age: int = Field(default=8, ge=1)
    """Versions after which a sample is no longer replayed (its behaviour logprobs age with it)."""
    min_sessions: int = Field(default=0, ge=0)
    """Fewest usable sessions a step trains on, and only after waiting `fill_timeout_s` for a full batch;
    0: half of `batch_sessions`."""
    fill_timeout_s: float = 30.0
    """Once a step has `min_sessions` usable sessions, how long it waits for `batch_sessions` more."""
    group_settle_s: float = 30.0
    """A group with a member still open (active in this long) is not claimed, so its baseline sees every
    member; after this long from its first finished member it is claimed anyway."""
    micro_batch_tokens: int = 2048
    """Padded tokens per forward/backward pass: bounds the step's activation memory (SmolLM2-135M:
    about 1 GB per 1k tokens in float32)."""
    lr: float = 2e-4
    """AdamW learning rate. 2e-4 suits the default LoRA adapter; full fine-tuning wants far less (1e-5)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    lora: bool = True
    """Train a LoRA adapter (peft) instead of all weights: a cheaper step and a small optimizer state."""
    lora_rank: int = 16
    """LoRA rank."""
    lora_alpha: int = 32
    """LoRA alpha."""
    gamma: float = 1.0
    """Discount for per-call rewards back over the turns of a trajectory."""
    baseline_momentum: float = 0.9
    """Running-baseline EMA momentum for groups of one."""
    sft_min_reward: float = 1.0
    """Reward threshold for `sft`."""
    dpo_beta: float = 0.1
    """DPO temperature."""
    lease_s: float = 600.0
    """How long a claim on sessions lasts before another trainer may take them."""
    poll_s: float = 1.0
    """Wait between checks for ready sessions."""
    checkpoint_dir: Path = Path("checkpoints")
    """Where versions are written (a directory each: weights or adapter, optimizer, trainer state)."""
    keep_checkpoints: int = 3
    """Older checkpoint directories are deleted (their store rows stay)."""
    state_in_background: bool = True
    """Write each version's resume state (trainable weights and optimizer moments, `sharded/`; nothing serves
    it) from a copy, in the background while the next step gathers and trains, instead of before the version
    is recorded and published. The copy takes host memory the size of that state (for full fine-tuning, the
    weights and two moments per weight). A trainer stopped in that window resumes from the version's weights
    with fresh optimizer moments. The local backend only: the fsdp backend's workers always write it first (a write
    thread's collectives would race the next step's)."""
    publish_overlap: bool = False
    """Publish each version on a thread of its own while the next step gathers and trains, instead of before
    it: the publish (loading into the engine, the probe) leaves the step's critical path. The next version's
    publish waits for this one, so versions are served in order; sessions sampled meanwhile come from the
    version before, one more version of staleness at most. `mode: async` only, and not with
    `promotion.mode: canary` (the trainer must see a canary's decision before it steps on)."""
    max_steps: int | None = None
    """Stop after this many steps, every named policy's counted (None: run until stopped)."""
    publish: Literal["auto", "lora", "reload", "inprocess", "none"] = "auto"
    """How new weights reach the engine: vLLM LoRA load, vLLM in-place reload, in-process swap.
    `reload` with `lora: true` merges each adapter into the base weights and serves those. `auto`:
    in-process swap for the transformers engine; for vLLM, `lora` when this machine has a CUDA device
    and `reload` otherwise (vLLM on CPU serves an adapter at about half the speed of plain weights)."""
    weight_transfer: Literal["auto", "disk", "shm", "ipc"] = "auto"
    """How full weights (`publish: reload`) reach vLLM. `disk`: vLLM reads the checkpoint. `shm`: sent from
    the trainer's memory through a file in /dev/shm, for vLLM on CPU (needs tracetrain installed beside vLLM:
    its plugin adds the backend; the fsdp backend gathers the weights from its workers through Ray's object
    store first). `ipc`: sent by CUDA IPC, trainer and vLLM on one GPU (the local backend only). The checkpoint
    is written either way, and a reload from it is the fallback when a transfer fails
    (engines/weight_transfer.py). `auto`: `ipc` where it applies (`serve --train` with the local backend,
    servers started here, one gateway process, vLLM on the trainer's own GPU), else `disk`: with vLLM on
    the CPU the reload reads the just-written checkpoint from the page cache and was faster than `shm` in
    the demo (bench/results/learning_arms.md, arms grouped and grouped+disk)."""
    seed: int = 0
    """Seed for the trainer's randomness."""
    backend: Literal["auto", "local", "fsdp"] = "auto"
    """Where a step runs. `local`: this process (today's loop); `fsdp`: torch FSDP2 over `workers` Ray
    actors, one per device (gloo on CPU, NCCL on GPUs); `auto`: fsdp when workers > 1."""
    workers: int = Field(default=1, ge=1)
    """Training processes for `fsdp`: one per GPU, or on CPU a share of the cores each."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer computes; `auto`: cuda when there is a CUDA device."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute precision. bfloat16 keeps float32 master weights, optimizer state and gradient reduction."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass: less memory, about a third more
    compute."""
    shared_prefix: bool = True
    """Run the tokens every sequence of a forward/backward pass begins with once, not once per sequence:
    the other sequences read their keys and values, and their gradients flow back through that one pass
    (trainer/step.py `SampledLogits`). Same gradients up to float rounding; agents that open every prompt
    with the same instructions and examples, and groups that repeat one prompt, train several times
    faster. Off by default with `activation_checkpointing` or `torch_compile`, and refused with them:
    neither keeps the keys and values the shared pass hands on."""
    torch_compile: bool = False
    """Compile each decoder layer with torch.compile: its norms, activations and rotary embeddings run
    as fused kernels instead of one kernel each. The first steps are slower while it compiles (again for
    each new sequence length until it compiles for any length); on a CPU it needs a C++ compiler."""
    ray_address: str | None = None
    """Ray cluster to place `fsdp` workers on (`auto` for the one this machine belongs to); None starts
    a local Ray."""
    gpus: Annotated[list[int], NoDecode] = Field(default_factory=list)
    """GPUs the trainer's workers use, one each (`0` or `2,3` or `4-7`, numbered as CUDA_VISIBLE_DEVICES
    orders them). Empty: the GPUs after the engine's, or on one GPU the GPU the engine uses (see
    `engine.gpus`)."""

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpu_list(cls, value: Any) -> Any:
        return index_list("train.gpus", value)

    @property
    def uses_fsdp(self) -> bool:
        return self.backend == "fsdp" or (self.backend == "auto" and self.workers > 1)

    def publishes_merged(self) -> bool:
        """Whether LoRA training reaches the engine as merged full weights. A command settles `publish`
        when it starts (`Config.settled`); a `TrainConfig` used on its own with `publish: auto` follows
        the same rule as there: merged without a CUDA device."""
        if not self.lora:
            return False
        if self.publish == "auto":
            return not cuda_here()
        return self.publish == "reload"

    @model_validator(mode="after")
    def _check_batch(self) -> TrainConfig:
        recomputing = [name for name in ("activation_checkpointing", "torch_compile") if getattr(self, name)]
        if recomputing and self.shared_prefix:
            if "shared_prefix" in self.model_fields_set:
                raise ValueError(f"train.shared_prefix cannot be used with train.{recomputing[0]}: it hands the "
                                 f"shared beginning's keys and values on, which {recomputing[0]} does not keep")
            self.shared_prefix = False
        if self.min_sessions == 0:
            self.min_sessions = max(1, self.batch_sessions // 2)
        if self.backend == "local" and self.workers > 1:
            raise ValueError(f"train.workers={self.workers} needs train.backend fsdp (or auto); local is one process")
        if self.replay_successes and self.algorithm != "rl":
            raise ValueError(f"train.replay_successes trains replayed samples with the policy loss: it needs "
                             f"train.algorithm rl, not {self.algorithm}")
        if self.uses_fsdp and self.algorithm != "rl":
            raise ValueError(f"train.algorithm {self.algorithm} runs on the local backend only (fsdp trains rl)")
        if self.weight_transfer == "ipc" and self.uses_fsdp:
            raise ValueError("train.weight_transfer=ipc sends CUDA tensors held by the trainer's own process, and "
                             "fsdp's are on its Ray workers: use shm (vLLM on the CPU) or disk")
        if self.ray_address is not None and not self.uses_fsdp:
            raise ValueError("train.ray_address places fsdp workers: set train.backend=fsdp or train.workers > 1")
        if not 1 <= self.min_sessions <= self.batch_sessions:
            raise ValueError(f"train.min_sessions ({self.min_sessions}) must be between 1 and train.batch_sessions "
                             f"({self.batch_sessions})")
        return self


POLICY_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
"""A policy's name: what `/p/{policy}/v1/…` and `model: <name>` carry, and the name of its adapters."""
POLICY_NAME_RE = re.compile(POLICY_NAME_PATTERN)
POLICY_NAME_RULE = "1 to 64 characters: lowercase letters, digits, '.', '_' and '-', starting with a letter or digit"
DEFAULT_POLICY = "default"
"""The policy every unbound session belongs to (store/models.py has the same name for the store's rows)."""
POLICY_TRAIN_SETTINGS = frozenset({
    "algorithm", "advantage", "policy_loss", "loss_agg_mode", "clip_ratio", "clip_ratio_low", "clip_ratio_high",
    "ppo_epochs", "kl_coef", "kl_type", "entropy_coef", "tis_cap", "max_staleness", "batch_sessions",
    "min_sessions", "lr", "weight_decay", "grad_clip", "lora_alpha", "gamma", "baseline_momentum", "sft_min_reward",
    "dpo_beta", "seed", "replay_successes", "replay_max_age"})
"""`train.*` settings a policy may set for itself: how its line learns. Where and on what the trainer runs
(devices, backend, workers, mode, checkpoints, publishing) is one trainer's, shared by every policy."""


def policy_problem(name: str, training: str, settings: dict[str, Any], train: TrainConfig | None = None) -> str | None:
    """Why a policy cannot be created as asked, in a sentence; None when it can. The same check for the
    config file's `gateway.policies` and for `POST /v1/policies`: the name, LoRA only, and each setting
    valid on top of `train` (the config's trainer settings)."""
    if not POLICY_NAME_RE.fullmatch(name):
        return f"Policy name {name!r} is not valid: {POLICY_NAME_RULE}."
    if training != "lora":
        return (f"Policy {name!r} asks for {training!r} training; every policy is a line of LoRA adapters on the "
                "shared base model, and full-weight training would change the base model under every other "
                "policy. Use training: lora.")
    unknown = sorted(set(settings) - POLICY_TRAIN_SETTINGS - {"retention_days"})
    if unknown:
        return (f"Policy {name!r} sets {', '.join(unknown)}, which a policy cannot set for itself; it may set "
                f"retention_days and {', '.join(sorted(POLICY_TRAIN_SETTINGS))}.")
    retention = settings.get("retention_days")
    if retention is not None and (not isinstance(retention, int) or isinstance(retention, bool) or retention < 1):
        return f"Policy {name!r}: retention_days must be a whole number of days, 1 or more, or null (forever)."
    overrides = {k: v for k, v in settings.items() if k != "retention_days"}
    try:
        TrainConfig.model_validate({**(train or TrainConfig()).model_dump(), **overrides})
    except ValidationError as exc:
        what = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'train'}: {e['msg']}" for e in exc.errors())
        return f"Policy {name!r} has train settings that are not valid: {what}."
    return None


class PolicySpec(BaseModel):
    """A named policy declared in the config file: a line of LoRA versions on the shared base model
    (docs/architecture.md, decision 13)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    """What binds an agent to it: a key's `policy`, the path `/p/{name}/v1/…`, or `model: {name}`."""
    training: str = "lora"
    """`lora`, the only kind a policy may train: a full-weight policy would move every other policy's base."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """Its own `train.*` settings (`lr`, `advantage`, …) and `retention_days` (its sessions' content, in place
    of `store.retention_days`; null: forever; a key's own still wins); the rest follow the config."""


class ApiKey(BaseModel):
    """An agent key with its settings, where a plain string is the key with the defaults."""

    model_config = ConfigDict(extra="forbid")
    key: str = Field(min_length=1)
    """The key itself."""
    train: bool = True
    """False: sessions this key creates are served and kept for audit, but never trained on or exported
    for training (counted as set aside with reason `no_train_key`)."""
    retention_days: int | None = Field(default=None, ge=1)
    """This key's sessions keep their content this many days after their last activity, in place of
    `store.retention_days` and its policy's own; set to null, forever. Left out: its policy's
    `retention_days` if it has one, else `store.retention_days`."""
    redaction: Literal["off", "detect", "redact"] | None = None
    """This key's redaction mode in place of `gateway.redaction` (a key whose users' data must be
    kept as sent, or one that must never be). None: `gateway.redaction`. (Per policy once named policies exist.)"""
    policy: str | None = None
    """The named policy (`gateway.policies`) every call with this key belongs to; the key cannot reach
    another policy's sessions or send it traffic (403). None: the call's path or model name decides, else
    the default policy."""


class EngineConfig(BaseModel):
    """Which engine serves, the model it serves, the vLLM servers it starts or reaches, and how calls are spread
    over them."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    kind: Literal["auto", "vllm", "transformers"] = "auto"
    """`vllm` starts or connects to a vLLM server; `transformers` runs in-process; `auto` picks vLLM
    when it is installed."""
    urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Base URLs of running vLLM servers (http://host:port, or unix:/path/to/socket for one started
    with `--uds`) instead of starting one; several make replicas: sessions stick to one, new sessions
    go to the least loaded (`--engine-url`, once per server)."""
    replicas: int = Field(default=1, ge=1)
    """vLLM servers to start on this machine (each on its own socket, see `engine.vllm_listen`) when no
    `engine.urls` are given."""
    routing: Literal["sticky", "round_robin"] = "sticky"
    """`sticky`: a session's calls go to the replica holding its prefix, new sessions to the least
    loaded; `round_robin`: every call to the next replica (no affinity; for comparison)."""
    spill_at: int = Field(default=8, ge=1)
    """Outstanding requests on a session's replica at which its next call goes to a less loaded one
    (recorded as `route: spill`): the prefix is recomputed there, but the call does not queue."""
    max_outstanding: int = Field(default=64, ge=1)
    """Requests the gateway has outstanding on one replica at most; beyond it requests wait."""
    queue_wait_s: float = Field(default=30.0, ge=0)
    """How long a request waits for room on a replica before it is answered 429 with `Retry-After`."""
    queue_limit: int = Field(default=1024, ge=0)
    """Requests that may wait for room at once; more are answered 429 at once."""
    model: str = "smollm2"
    """Model directory, or `smollm2` for the embedded SmolLM2-135M-Instruct (converted once, cached)."""
    served_model_name: str = "smollm2-135m-instruct"
    """Name clients put in `model`; requests naming another model get 404."""
    vllm_python: str | None = None
    """Python executable of the environment where vLLM is installed (default: .venv-vllm, then
    TRACETRAIN_VLLM_PYTHON)."""
    vllm_listen: Literal["socket", "tcp"] = "socket"
    """Where the vLLM servers the gateway starts listen. `socket`: a Unix socket in a directory only
    this user may enter, so nothing but the gateway (and this user) reaches them. `tcp`: loopback ports
    from `engine.vllm_port`, where every local process reaches their development endpoints (`/pause`,
    `/collective_rpc`, LoRA loading), which vLLM's `--api-key` does not guard; for tools that must
    reach the server by port."""
    vllm_port: int = 8100
    """Port of the first vLLM server the gateway starts, with `engine.vllm_listen: tcp` (ignored otherwise)."""
    vllm_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for the vLLM server the gateway starts."""
    gpus: Annotated[list[int], NoDecode] = Field(default_factory=list)
    """GPUs of the vLLM servers started here, one per replica (`0` or `0,1`, numbered as
    CUDA_VISIBLE_DEVICES orders them). Empty: the first `engine.replicas` GPUs. The trainer takes the GPUs
    after them (`train.gpus`); on a machine with one GPU both use it (docs/architecture.md, "GPUs")."""
    memory_share: float | None = Field(default=None, gt=0, le=0.98)
    """Share of its GPU's memory a vLLM server started here may take (`--gpu-memory-utilization`). None:
    0.9 on a GPU of its own; on a GPU it shares with the trainer 0.6 in `sync` mode (vLLM sleeps while
    the trainer steps) and 0.45 in `async` mode (both compute at once)."""
    sleep: Literal["auto", "on", "off"] = "auto"
    """Whether vLLM sleeps (level 1: weights to host memory, KV cache dropped) while a `sync`-mode step
    trains, and wakes for the new version: the trainer then has the GPU's memory to itself. `auto`: on
    when the engine and the trainer share a GPU in `sync` mode. CUDA only."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The dtype vLLM serves in: passed as `--dtype` to the servers started here, and the dtype whose
    tolerance the publish probe uses (`engine.publish_probe`). `auto`: bfloat16 for servers started on
    GPUs, float32 for servers on the CPU, and for servers given by `engine.urls` (dtype unknown here)
    bfloat16's wider tolerance."""
    block_size: int | None = Field(default=None, gt=0, multiple_of=16)
    """Tokens per KV-cache block of the vLLM servers started here (vLLM's `--block-size`; None: vLLM's own, 128
    on the CPU). vLLM's prefix cache reuses whole blocks only, so on the CPU no prompt under 128 tokens is ever
    reused (the demo's are 78). 32 makes the demo's generation about twice as fast, but the demo learned less
    with it and `cpu_cores: all` (docs/architecture.md, "vLLM on the CPU"), so it is not the default."""
    cpu_cores: Literal["vllm", "all"] = "vllm"
    """The cores one vLLM server started on the CPU computes on. `vllm`: vLLM's own binding, every core but one,
    which it leaves to its API process. `all`: every core this process may use, for a `sync`-mode trainer in
    this process, which idles while vLLM generates (docs/architecture.md, "vLLM on the CPU"). Several replicas
    on the CPU share the cores out between them whatever this says."""
    publish_probe: bool = True
    """After loading a version into a replica, score a fixed sequence there and compare its logprobs with
    the trainer's for the new weights (engines/probe.py). A replica that does not match is taken out of
    routing and does not serve the version; the figures go on the version's row."""
    publish_probe_tolerance: float | None = Field(default=None, gt=0)
    """Largest mean |logprob difference| a replica's probe may show. None: by `engine.dtype` (float32
    2e-3, float16 2e-2, bfloat16 5e-2)."""
    timeout_s: float = 300.0
    """Longest wait for the engine on one request before answering 504."""
    max_loras: int = Field(default=3, ge=1)
    """LoRA adapters one vLLM batch may mix (vLLM's `--max-loras`, for the servers started here; give servers
    in `engine.urls` the same). Each named policy serves its own adapter beside the default policy's, so
    `gateway.policies` may declare at most `max_loras - 1` of them, and `POST /v1/policies` refuses more."""
    json_max_whitespace: int | None = Field(default=64, ge=1)
    """vLLM: at most this many consecutive whitespace characters in constrained JSON (forced tool
    calls, `response_format`), per request through an xgrammar structural tag. Enough for a model that
    indents nested objects (a newline plus a few levels of indentation), too few to pad until
    max_tokens. None: the server's setting."""

    @field_validator("urls", mode="before")
    @classmethod
    def _one_url(cls, value: Any) -> Any:
        """One URL as a plain string (YAML, `TRACETRAIN_ENGINE__URLS=http://…`) is a list of one."""
        if value is None:
            return []
        if isinstance(value, str):
            return [u for u in value.replace(",", " ").split() if u]
        return value

    @field_validator("urls")
    @classmethod
    def _urls_parse(cls, value: list[str]) -> list[str]:
        """Each URL in a form the engine can reach, checked here rather than at the first request."""
        from tracetrain.engines.vllm_server import engine_address

        for url in value:
            engine_address(url)
        return value

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpu_list(cls, value: Any) -> Any:
        return index_list("engine.gpus", value)

    @model_validator(mode="after")
    def _check_servers(self) -> EngineConfig:
        if self.urls and self.replicas > 1:
            raise ValueError("engine.replicas starts vLLM servers here; with engine.urls, list every server instead")
        if self.kind == "transformers" and (self.replicas > 1 or self.urls):
            raise ValueError("engine.kind: transformers runs in-process; engine.replicas and engine.urls need "
                             "engine.kind: vllm")
        if self.gpus and (self.urls or self.kind == "transformers"):
            raise ValueError("engine.gpus places the vLLM servers this gateway starts; with engine.urls or "
                             "engine.kind: transformers it starts none")
        if self.spill_at > self.max_outstanding:
            raise ValueError(f"engine.spill_at ({self.spill_at}) above engine.max_outstanding "
                             f"({self.max_outstanding}) would never spill")
        return self

    @property
    def servers(self) -> int:
        """vLLM servers the gateway sends to: those listed in `urls`, or the replicas it starts."""
        return len(self.urls) or self.replicas

    def starts_vllm(self) -> bool:
        """Whether the gateway starts vLLM servers of its own (no `urls`, not the in-process engine)."""
        return not self.urls and self.kind != "transformers"

    def vllm_available(self) -> bool:
        """A vLLM server to reach (`urls`) or a vLLM installation to start one with."""
        from tracetrain.engines.vllm_server import find_vllm_python

        return bool(self.urls) or (self.vllm_python or find_vllm_python()) is not None


class StoreConfig(BaseModel):
    """A SQLite (WAL) file for the processes of one host, or a PostgreSQL database, which several hosts can
    share; and how long sessions keep their content."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str = "sqlite:///tracetrain.db"
    """Store URL: SQLite (WAL) file or postgresql+psycopg://…"""
    sqlite_synchronous: Literal["FULL", "NORMAL"] = "FULL"
    """FULL survives power loss; NORMAL survives a killed process only, and commits faster."""
    retention_days: int | None = Field(default=None, ge=1)
    """Days a session keeps its content after its last activity; then a purge clears its messages, replies,
    token ids, logprobs and tool arguments and results, and keeps what the figures need (the session row
    with its counts, rewards, versions, timestamps and redaction counts); a purged session is never trained
    on or exported. None: kept forever. A named policy may set its own (its `retention_days` setting) and a
    key its own (`gateway.api_keys`), which wins over its policy's. The gateway purges every
    `store.retention_interval_s`; `tracetrain db purge` purges at once."""
    retention_interval_s: float = Field(default=3600.0, gt=0)
    """How often the gateway purges sessions past their retention (one batch of sessions per write
    transaction, beside the traffic); it also purges once as it starts."""


class GatewayConfig(BaseModel):
    """Where it listens, its processes, who may call it, what it keeps of each call, and when it holds new
    sessions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Address the gateway binds. Anything but loopback requires API keys."""
    port: int = 8000
    """Port of the gateway."""
    workers: int = Field(default=1, ge=1)
    """Gateway processes serving the port (`serve --workers N`); they share the store, the engines and
    the generation holds, and follow the versions any of them publishes. A LoRA version switches in
    every process within a second; a full-weight reload first waits until every process has stopped
    sending to the replica it reloads (proxy/replica_sync.py)."""
    cpus: Annotated[list[int], NoDecode] = Field(default_factory=list)
    """CPUs the gateway's processes run on (`--gateway-cpus 2,3` or `2-5`; Linux): one process on all of
    them, or with `gateway.workers` each worker on one, in turn. Its event loop and its store threads then
    share a core's caches instead of waking each other across cores, which costs less CPU per call on
    hosts with many cores (docs/benchmarks.md). Keep them off the cores vLLM's processes busy-poll on.
    Empty: wherever the scheduler puts them."""
    api_keys: list[str | ApiKey] = Field(default_factory=list)
    """Agent keys: each may create sessions and read or reward its own. An entry is the key, or
    `{key: …, train: false}` for a key whose sessions are never trained on (users who did not consent),
    `retention_days: N` for a key whose sessions keep their content N days (null: forever), and `policy: NAME`
    for a key bound to one of `gateway.policies` (it reaches that policy's sessions only)."""
    policies: list[PolicySpec] = Field(default_factory=list)
    """Named policies, each a line of LoRA versions on the shared base model with its own sessions and
    training settings: `[{name: support, settings: {lr: 1e-5}}]`. Checked as the config loads (names,
    LoRA only, their settings, `engine.max_loras`) and added to the store's registry when the gateway
    starts; `POST /v1/policies` adds more. The `default` policy always exists."""
    admin_key: str | None = None
    """Key for listing, export and weight endpoints (and every session)."""
    metrics_key: Literal["none", "any", "admin"] = "none"
    """Who may read `/metrics`: anyone (`none`, for a scraper on a private network), any configured key
    (`any`), or the admin key only (`admin`). Scrapers send the key as `Authorization: Bearer`."""
    redaction: Literal["off", "detect", "redact"] = "redact"
    """Personal data and secrets in what is stored (e-mail addresses, phone, card and IBAN numbers, API
    keys and bearer tokens, IP addresses, and `gateway.redaction_patterns`): `redact` stores each as a typed
    placeholder (`[EMAIL]`) and masks its tokens out of training; `detect` only counts them (per call and
    session, by type) and stores everything as sent; `off` runs no detector. Agents get real replies in
    every mode."""
    redaction_patterns: dict[str, str] = Field(default_factory=dict)
    """More detectors: placeholder name to regular expression (`{"employee_id": "EMP-\\d{6}"}` stores
    `[EMPLOYEE_ID]`); they take precedence over the built-in ones."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Requests with a larger body are refused with 413."""
    chat_template: Path | None = None
    """Jinja chat template to use instead of the model's (or the bundled tool-capable ChatML one)."""
    default_max_tokens: int = 512
    """max_tokens when a request gives none."""
    reward_weights: dict[str, float] = Field(default_factory=dict)
    """Weights for dict-valued rewards; a component without a weight counts 1."""
    log_level: str = "INFO"
    """Logging level of the gateway."""
    admission: Literal["auto", "none", "staleness"] = "auto"
    """`staleness` (training workloads): hold new sessions while the ready and in-flight sessions
    already fill `gateway.admission_batches` training batches, so the trainer is not fed work it would drop
    as stale. `none` (production agents): nothing is held; the trainer takes the freshest sessions.
    `auto`: `staleness` under `serve --train` in `async` mode; `none` in `sync` mode (holding
    generation while a batch trains already bounds staleness) and under `serve` (which cannot know
    whether a trainer elsewhere will ever publish, and must not hold agents for one)."""
    admission_batches: float = Field(default=1.0, gt=0)
    """Batches of `train.batch_sessions` that may be ready or in flight under `gateway.admission: staleness`.
    1 keeps the next batch generating while one trains; more keeps the engine busier, but the trainer
    takes the freshest sessions first, so what is beyond one batch ages and may go stale."""
    admission_wait_s: float = Field(default=120.0, ge=0)
    """How long a held new session waits for room before it is refused with 429 and `Retry-After`: long
    enough to cover a training step on most setups, so unchanged agents (the OpenAI SDK retries a 429
    twice) rarely see one, and well inside the SDKs' own request timeouts (600 s)."""

    @field_validator("redaction_patterns")
    @classmethod
    def _check_patterns(cls, value: dict[str, str]) -> dict[str, str]:
        for name, pattern in value.items():
            if not name.replace("_", "").isalnum():
                raise ValueError(f"redaction pattern name {name!r}: use letters, digits and underscores")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"redaction pattern {name!r} is not a regular expression: {exc}") from exc
        return value

    @field_validator("cpus", mode="before")
    @classmethod
    def _cpu_list(cls, value: Any) -> Any:
        return index_list("gateway.cpus", value)

    @field_validator("cpus")
    @classmethod
    def _cpus_exist(cls, value: list[int]) -> list[int]:
        if not value:
            return value
        if not hasattr(os, "sched_setaffinity"):
            raise ValueError("gateway.cpus needs Linux (CPU affinity)")
        if missing := sorted(set(value) - os.sched_getaffinity(0)):
            raise ValueError(f"gateway.cpus: CPU {missing} is not available to this process "
                             f"(available: {sorted(os.sched_getaffinity(0))})")
        return sorted(set(value))

    def agent_keys(self) -> list[str]:
        return [k if isinstance(k, str) else k.key for k in self.api_keys]

    def retention_by_key(self) -> dict[str, int | None]:
        """Keys whose `retention_days` differs from `store.retention_days`, with theirs (None: forever)."""
        return {k.key: k.retention_days for k in self.api_keys
                if isinstance(k, ApiKey) and "retention_days" in k.model_fields_set}

    def redaction_by_key(self) -> dict[str, Literal["off", "detect", "redact"]]:
        """Keys whose redaction mode is their own, with it."""
        return {k.key: k.redaction for k in self.api_keys if isinstance(k, ApiKey) and k.redaction is not None}

    def policy_by_key(self) -> dict[str, str]:
        """Keys bound to a named policy, with its name."""
        return {k.key: k.policy for k in self.api_keys if isinstance(k, ApiKey) and k.policy is not None}

    def untrained_keys(self) -> list[str]:
        """Keys whose sessions are never trained on."""
        return [k.key for k in self.api_keys if isinstance(k, ApiKey) and not k.train]

    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def check_access(self) -> None:
        """A gateway reachable from other machines must not run without keys."""
        if not self.is_loopback() and not (self.api_keys and self.admin_key):
            raise SystemExit(
                f"refusing to bind {self.host}: set gateway.api_keys and gateway.admin_key "
                "(TRACETRAIN_GATEWAY__API_KEYS, TRACETRAIN_GATEWAY__ADMIN_KEY) or bind 127.0.0.1"
            )


class PromotionConfig(BaseModel):
    """At once, or as a canary next to the incumbent, kept or rolled back by its sessions' rewards."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    mode: Literal["immediate", "canary"] = "immediate"
    """`immediate`: every published version serves every request at once (the demo's setting).
    `canary`: a new version first serves `promotion.canary_share` of *new* sessions next to the incumbent
    (a session keeps the version it started on); it is promoted when its sessions' final rewards are not
    worse than the incumbent's over the same period and rolled back when they are (proxy/promotion.py).
    With LoRA both adapters are loaded in every vLLM; with full weights the canary takes a subset of the
    replicas (two or more needed); the in-process engine holds both weight sets."""
    canary_share: float = Field(default=0.2, gt=0, lt=1)
    """Share of new sessions a canary version serves."""
    min_sessions: int = Field(default=20, ge=2)
    """Rewarded sessions each arm needs before the canary can be decided."""
    max_sessions: int = Field(default=200, ge=2)
    """Rewarded canary sessions at which an undecided canary is decided by its mean: promoted unless it
    is worse than the incumbent by more than `promotion.margin`."""
    margin: float = Field(default=0.05, ge=0)
    """How much lower the canary's mean reward may be and still count as not worse (non-inferiority
    margin, in reward units)."""
    alpha: float = Field(default=0.05, gt=0, lt=1)
    """Error rate of the sequential test, valid however often it is evaluated."""

    @model_validator(mode="after")
    def _check_sessions(self) -> PromotionConfig:
        if self.mode == "canary" and self.max_sessions < self.min_sessions:
            raise ValueError(f"promotion.max_sessions ({self.max_sessions}) below promotion.min_sessions "
                             f"({self.min_sessions})")
        return self


SECTIONS = ("engine", "store", "gateway", "train", "promotion")
"""`Config`'s groups of settings, in the order the documentation shows them."""

RENAMED: dict[str, str] = {
    "host": "gateway.host", "port": "gateway.port", "engine": "engine.kind", "engine_url": "engine.urls",
    "replicas": "engine.replicas", "gateway_workers": "gateway.workers", "gateway_cpus": "gateway.cpus",
    "replica_routing": "engine.routing", "replica_spill_at": "engine.spill_at",
    "replica_max_outstanding": "engine.max_outstanding", "replica_queue_wait_s": "engine.queue_wait_s",
    "replica_queue_limit": "engine.queue_limit", "model": "engine.model",
    "served_model_name": "engine.served_model_name", "vllm_python": "engine.vllm_python",
    "vllm_listen": "engine.vllm_listen", "vllm_port": "engine.vllm_port", "vllm_args": "engine.vllm_args",
    "engine_gpus": "engine.gpus", "engine_memory_share": "engine.memory_share", "engine_sleep": "engine.sleep",
    "engine_dtype": "engine.dtype", "publish_probe": "engine.publish_probe",
    "publish_probe_tolerance": "engine.publish_probe_tolerance", "engine_timeout_s": "engine.timeout_s",
    "json_max_whitespace": "engine.json_max_whitespace", "db_url": "store.url",
    "sqlite_synchronous": "store.sqlite_synchronous", "api_keys": "gateway.api_keys",
    "admin_key": "gateway.admin_key", "metrics_key": "gateway.metrics_key", "redaction": "gateway.redaction",
    "redaction_patterns": "gateway.redaction_patterns", "max_body_bytes": "gateway.max_body_bytes",
    "chat_template": "gateway.chat_template", "default_max_tokens": "gateway.default_max_tokens",
    "reward_weights": "gateway.reward_weights", "log_level": "gateway.log_level",
    "admission": "gateway.admission", "admission_batches": "gateway.admission_batches",
    "admission_wait_s": "gateway.admission_wait_s", "promotion": "promotion.mode",
    "canary_share": "promotion.canary_share", "canary_min_sessions": "promotion.min_sessions",
    "canary_max_sessions": "promotion.max_sessions", "canary_margin": "promotion.margin",
    "canary_alpha": "promotion.alpha", "retention_days": "store.retention_days",
    "retention_interval_s": "store.retention_interval_s",
}
"""Settings of the flat configuration before it was grouped, and where each is now: an old name in YAML, the
environment or `--set` is refused with its new place (`renamed_hint`), never taken silently."""


def env_var(path: str) -> str:
    """The environment variable of a dotted setting: `engine.urls` is `TRACETRAIN_ENGINE__URLS`."""
    return "TRACETRAIN_" + "__".join(path.split(".")).upper()


def renamed_hint(names: list[str]) -> str:
    """The sentence that refuses old flat names: where each one lives now, and how to spell it there."""
    moves = "; ".join(f"{name} is now {RENAMED[name]} (in YAML under `{RENAMED[name].split('.')[0]}:`, "
                      f"{env_var(RENAMED[name])}, --set {RENAMED[name]}=…)" for name in names)
    return f"settings are grouped by concern ({', '.join(SECTIONS)}): {moves}"


class _Environment(EnvSettingsSource):
    """`TRACETRAIN_…` variables, with the old flat names passed on (not dropped as unknown) so that the config
    refuses them with their new place."""

    def __call__(self) -> dict[str, Any]:
        values = super().__call__()
        for name in RENAMED:
            if name in SECTIONS or name == "vllm_python":  # TRACETRAIN_VLLM_PYTHON also names vLLM's Python
                continue
            value = self.env_vars.get(f"tracetrain_{name}")
            if value is not None:
                values[name] = value
        return values

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        """`TRACETRAIN_ENGINE=vllm` was a setting of its own; now `engine` is a group, read as JSON. Such a
        value is passed on as it is, for the config to refuse with its new name."""
        try:
            return super().decode_complex_value(field_name, field, value)
        except ValueError:
            if field_name in RENAMED:
                return value
            raise


class Config(BaseSettings):
    """Every setting, grouped by concern."""

    model_config = SettingsConfigDict(env_prefix="TRACETRAIN_", env_nested_delimiter="__", extra="forbid",
                                      use_attribute_docstrings=True)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Highest first: explicit values (CLI flags), environment, the YAML file given to `load_config`."""
        return init_settings, _Environment(settings_cls), YamlConfigSettingsSource(settings_cls,
                                                                                   yaml_file=_YAML_FILE.get())

    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The inference engine: vLLM servers, or the in-process transformers engine."""
    store: StoreConfig = Field(default_factory=StoreConfig)
    """Where sessions, calls, rewards and versions are kept."""
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    """The gateway agents and operators call."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """The trainer (`serve --train` or `tracetrain train`)."""
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
    """How a newly published version comes to serve."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_old_names(cls, data: Any) -> Any:
        """An old flat name (`engine_url`, or `engine: vllm`) is refused with its new place."""
        if isinstance(data, dict):
            old = [name for name, value in data.items() if name in RENAMED
                   and (name not in SECTIONS or not isinstance(value, dict | BaseModel))]
            if old:
                raise ValueError(renamed_hint(old))
        return data

    @model_validator(mode="after")
    def _check_across(self) -> Config:
        """Combinations of settings from different groups."""
        engine, gateway = self.engine, self.gateway
        if gateway.workers > 1 and engine.kind == "transformers":
            raise ValueError("gateway.workers > 1 needs engine.kind: vllm (each worker would load its own model)")
        if gateway.cpus and engine.kind == "transformers":
            raise ValueError("gateway.cpus confines the gateway's process, and engine.kind: transformers generates "
                             "in it: use engine.kind: vllm, or leave gateway.cpus empty")
        if gateway.workers > 1 and self.promotion.mode == "canary" and self.publishes_full_weights():
            raise ValueError("gateway.workers > 1 with promotion.mode: canary needs LoRA publishing (train.lora and "
                             "train.publish: lora): a full-weight canary's replicas are chosen by one process")
        if (self.promotion.mode == "canary" and engine.kind != "transformers" and self.publishes_full_weights()
                and engine.servers == 1):
            raise ValueError("promotion.mode: canary with full weights needs two or more vLLM replicas (--replicas 2, "
                             "or several --engine-url): the canary is loaded into some of them while the rest "
                             "serve the incumbent. On one server, use LoRA publishing (train.lora and "
                             "train.publish: lora): both adapters then live in it")
        self._check_policies()
        if self.train.publish_overlap and self.train.mode == "sync":
            raise ValueError("train.publish_overlap with train.mode: sync: a sync step holds generation until its "
                             "version serves, so there is nothing to overlap. Use train.mode: async")
        if self.train.publish_overlap and self.train.keep_checkpoints < 2:
            raise ValueError("train.publish_overlap with train.keep_checkpoints below 2: the next step's checkpoint "
                             "would delete the version still being published. Keep 2 or more")
        if self.train.publish_overlap and self.promotion.mode == "canary":
            raise ValueError("train.publish_overlap with promotion.mode: canary: the trainer must see each canary "
                             "staged and decided before it steps on. Leave train.publish_overlap off")
        if gateway.admission != "none" and gateway.admission_batches > self.train.max_staleness + 1:
            raise ValueError(f"gateway.admission_batches ({gateway.admission_batches:g}) above "
                             f"train.max_staleness + 1 ({self.train.max_staleness + 1}) admits sessions that can "
                             "only go stale")
        return self

    def _check_policies(self) -> None:
        """`gateway.policies` and the keys bound to them, refused with a sentence as the config loads."""
        declared = [p.name for p in self.gateway.policies]
        for spec in self.gateway.policies:
            if problem := policy_problem(spec.name, spec.training, spec.settings, self.train):
                raise ValueError(f"gateway.policies: {problem}")
        if dupes := sorted({n for n in declared if declared.count(n) > 1}):
            raise ValueError(f"gateway.policies: {', '.join(dupes)} declared more than once")
        if DEFAULT_POLICY in declared:
            raise ValueError(f"gateway.policies: {DEFAULT_POLICY!r} always exists; it takes the config's own train "
                             "settings, so leave it out")
        if self.engine.served_model_name in declared:
            raise ValueError(f"gateway.policies: {self.engine.served_model_name!r} is engine.served_model_name; a "
                             "policy needs a name of its own, or `model: <name>` could not tell the two apart")
        if len(declared) + 1 > self.engine.max_loras:
            raise ValueError(f"gateway.policies declares {len(declared)} policies; with the default one that is "
                             f"{len(declared) + 1} LoRA adapters, more than engine.max_loras "
                             f"({self.engine.max_loras}) lets vLLM serve at once. Raise engine.max_loras or "
                             "declare fewer policies")
        if declared and self.train.uses_fsdp:
            raise ValueError("gateway.policies with train.backend: fsdp: the fsdp backend trains the default "
                             "policy's line only, so the named policies would never learn. Use train.backend: local "
                             "(one process, one base model with an adapter and an optimizer per policy)")
        if declared and not self.train.lora:
            raise ValueError("gateway.policies with train.lora: false: the default policy would train the base "
                             "model's full weights, which every named policy's adapter sits on. Use train.lora: true")
        if declared and self.train.publish == "reload":
            raise ValueError("gateway.policies with train.publish: reload: merged full weights would put the default "
                             "policy's adapter under every named policy's. Use train.publish: lora (or auto)")
        for policy in self.gateway.policy_by_key().values():
            if policy != DEFAULT_POLICY and policy not in declared:
                raise ValueError(f"gateway.api_keys: a key is bound to policy {policy!r}, which "
                                 "gateway.policies does not declare")

    @model_validator(mode="after")
    def _check_gpus(self) -> Config:
        """Settings that name GPUs are checked against this machine's when the config loads; the defaults
        are resolved by `gpu_plan` once the command knows whether it trains here."""
        if self.engine.gpus or self.train.gpus or self.engine.sleep == "on":
            self.gpu_plan(training_here=bool(self.train.gpus) or self.engine.sleep == "on")
        return self

    def updated(self, **sections: dict[str, Any]) -> Config:
        """This config with some fields of its groups replaced, unvalidated as `model_copy` is:
        `config.updated(engine={"urls": urls}, gateway={"cpus": []})`."""
        return self.model_copy(update={name: getattr(self, name).model_copy(update=fields)
                                       for name, fields in sections.items()})

    def gpu_plan(self, *, training_here: bool) -> GPUPlan:
        """How vLLM's replicas and the trainer share this machine's GPUs (engines/gpus.py); ValueError
        with a sentence when they cannot."""
        from tracetrain.engines.gpus import plan_gpus, visible_gpus

        on_gpu = training_here and self.train.device != "cpu" and not self.train.ray_address
        return plan_gpus(visible=len(visible_gpus()), replicas=self.engine.replicas if self.engine.starts_vllm() else 0,
                         workers=self.train.workers if on_gpu else 0, engine_gpus=self.engine.gpus,
                         trainer_gpus=self.train.gpus, mode=self.train.mode, memory_share=self.engine.memory_share,
                         sleep=self.engine.sleep)

    def publish_mode(self) -> Literal["lora", "reload", "inprocess", "none"]:
        """How new weights reach the engine: `train.publish`, with `auto` decided here and nowhere else.
        In-process swap for the transformers engine. For vLLM, full weights reloaded unless LoRA is
        trained; a LoRA adapter is loaded as one when this machine has a CUDA device, when several gateway
        processes share the servers (an adapter switch needs no drain of every process), or for a canary on
        one server (only adapters let both versions live in it); otherwise it is merged and reloaded (vLLM
        on CPU serves an adapter at about half the speed of plain weights)."""
        if self.train.publish != "auto":
            return self.train.publish
        if self.engine.kind == "transformers":
            return "inprocess"
        if not self.train.lora:
            return "reload"
        if self.gateway.workers > 1 or (self.promotion.mode == "canary" and self.engine.servers == 1):
            return "lora"
        if self.gateway.policies:  # each policy's line is its own adapter, on the base model
            return "lora"
        return "reload" if self.train.publishes_merged() else "lora"

    def publishes_full_weights(self) -> bool:
        return self.publish_mode() == "reload"

    def settled(self, *, training_here: bool) -> Config:
        """This config with every `auto` decided, once, as a command starts: the engine (vLLM when it is
        installed), the GPU split and vLLM's memory share, sleep and dtype (`gpu_plan`), admission (held for
        an async trainer in this process only), and the trainer's publish mode, backend and device. What
        follows reads concrete values only. ValueError with a sentence when the GPU split cannot work."""
        kind = self.engine.kind
        if kind == "auto":
            kind = "vllm" if self.engine.vllm_available() else "transformers"
            if kind == "transformers":
                log.warning("vLLM is not installed: falling back to the in-process transformers engine")
        config = self.updated(engine={"kind": kind})
        plan = config.gpu_plan(training_here=training_here)
        dtype = self.engine.dtype
        if dtype == "auto":  # what engine.dtype's docstring promises
            dtype = "bfloat16" if plan.engine or self.engine.urls else "float32"
        admission = self.gateway.admission
        if admission == "auto":
            admission = "staleness" if training_here and self.train.mode == "async" else "none"
        train: dict[str, Any] = {"gpus": plan.trainer, "publish": config.publish_mode(),
                                 "backend": "fsdp" if self.train.uses_fsdp else "local",
                                 "weight_transfer": config.memory_transfer(plan, training_here=training_here)}
        if training_here and self.train.device == "auto":
            train["device"] = "cuda" if cuda_here() else "cpu"
        return config.updated(engine={"gpus": plan.engine, "memory_share": plan.memory_share,
                                      "sleep": "on" if plan.sleep else "off", "dtype": dtype},
                              gateway={"admission": admission}, train=train)

    def memory_transfer(self, plan: GPUPlan, *, training_here: bool) -> Literal["disk", "shm", "ipc"]:
        """`train.weight_transfer` decided, as its docstring says `auto` is."""
        chosen = self.train.weight_transfer
        if chosen != "auto":
            return chosen
        applies = (training_here and self.engine.kind == "vllm" and self.publish_mode() == "reload"
                   and not self.engine.urls and self.gateway.workers == 1)
        if not applies:
            return "disk"
        # vLLM on the CPU: `disk`. The checkpoint is written anyway and vLLM reads it back from the page
        # cache, while `shm` merges and copies the weights once more (bench/results/learning_arms.md).
        one_gpu = bool(plan.engine) and plan.engine == plan.trainer and len(plan.engine) == 1
        return "ipc" if one_gpu and not self.train.uses_fsdp else "disk"

    @property
    def admission_limit(self) -> int:
        """Ready plus in-flight sessions above which `gateway.admission: staleness` holds new sessions."""
        return self.admission_limit_for(self.train.batch_sessions)

    def admission_limit_for(self, batch_sessions: int) -> int:
        """The same for a named policy that trains on batches of its own size."""
        return max(1, round(self.gateway.admission_batches * batch_sessions))


_YAML_FILE: ContextVar[Path | None] = ContextVar("tracetrain_yaml_file", default=None)
"""The YAML file `load_config` reads (a context variable: pydantic-settings builds sources per class)."""


def index_list(name: str, value: Any) -> Any:
    """`2,3,8-11` (a flag, YAML or an environment variable) as the list of numbers it names."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if not isinstance(value, str):
        return value
    numbers: list[int] = []
    for part in value.replace(" ", "").split(","):
        if not part:
            continue
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            noun = "CPU" if "cpu" in name else "GPU"
            raise ValueError(f"{name}: {part!r} is not a {noun} number or range (e.g. 2,3 or 8-11)")
        numbers += range(int(first), int(last or first) + 1)
    return numbers


def cuda_here() -> bool:
    """Whether torch sees a CUDA device here; a process without torch (a gateway in front of vLLM) has none."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch  # here, not at the top: loading a config must not cost a torch import

    return bool(torch.cuda.is_available())


def load_config(yaml_path: Path | None = None, **overrides: Any) -> Config:
    """Defaults < YAML file < `TRACETRAIN_…` environment < `overrides` (CLI flags, nested dicts merge)."""
    token = _YAML_FILE.set(yaml_path)
    try:
        return Config(**overrides)
    finally:
        _YAML_FILE.reset(token)


def groups() -> dict[str, type[BaseModel]]:
    """`Config`'s groups of settings and their models (`engine`: `EngineConfig`), in `SECTIONS` order."""
    found = {name: field.annotation for name, field in Config.model_fields.items()}
    return {name: model for name in SECTIONS
            if isinstance(model := found.get(name), type) and issubclass(model, BaseModel)}


def setting_field(path: str) -> FieldInfo:
    """The field of a dotted setting (`engine.kind`); KeyError for one that does not exist."""
    group, name = path.split(".")
    return groups()[group].model_fields[name]


def parse_set(assignments: list[str]) -> dict[str, Any]:
    """`--set` flags, the same keys in every subcommand: a group and a setting (`engine.kind=vllm`,
    `train.lr=1e-4`), and a bare name that only the trainer has stands for its `train.` key (`lr=1e-4`).
    Values parse as YAML. Unknown names are refused here, before any work; an old flat name with its new
    place."""
    result: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set needs KEY=VALUE, got {assignment!r}")
        path = key.split(".")
        if len(path) == 1 and key in TrainConfig.model_fields:
            path = ["train", key]
        elif len(path) == 1 and key in RENAMED:
            raise SystemExit(f"--set {key}: {renamed_hint([key])}")
        model = groups().get(path[0])
        if len(path) != 2 or model is None or path[1] not in model.model_fields:
            known = "; ".join(f"{name}.{{{', '.join(group.model_fields)}}}" for name, group in groups().items())
            raise SystemExit(f"--set {key}: no such setting (a group and a setting: {known}; a bare name only "
                             "the trainer has stands for train.NAME)")
        result.setdefault(path[0], {})[path[1]] = yaml.safe_load(raw)
    return result
