"""One FSDP2 worker: a process (a Ray actor, trainer/fsdp_backend.py) holding its shard of the model and
the optimizer on one device.

Each decoder layer is its own FSDP unit and the `SampledLogits` wrapper is the root (embeddings, final
norm and head, which SmolLM2 ties). Weights stay float32 ("master weights"); with `dtype: bfloat16`
FSDP casts them to bfloat16 for compute and reduces gradients in float32 (`MixedPrecisionPolicy`).
The step itself is trainer/step.py's, on this worker's share of the batch.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tracetrain.config import TrainConfig
from tracetrain.trainer import checkpoint, memory
from tracetrain.trainer.data import Sample
from tracetrain.trainer.devices import compile_layers, resolve_device
from tracetrain.trainer.step import BatchShare, SampledLogits, StepInputs, token_logprobs, train_step

log = logging.getLogger(__name__)


class FSDPWorker:
    model: Any
    """The Hugging Face (or PEFT) model inside `policy`, sharded in place."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port on it, for the process group's TCP rendezvous.

        The address is the one Ray reaches this node by (not a loopback address), so workers on other
        nodes can connect; the port is probed on every interface, as the rendezvous store listens."""
        import ray

        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, cfg: TrainConfig, base_dir: Path, master: tuple[str, int], resume: Path | None
              ) -> dict[str, Any]:
        """Join the process group, build and shard the model, load `resume`'s sharded state."""
        import ray

        started = time.perf_counter()
        self.cfg = cfg
        self.device = resolve_device(cfg)
        if self.device == "cuda":
            torch.cuda.set_device(0)  # Ray shows each actor only its own GPU
        else:
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
            _gloo_on_node_address()
        dist.init_process_group("nccl" if self.device == "cuda" else "gloo", init_method=f"tcp://{master[0]}:{master[1]}",
                                rank=self.rank, world_size=self.world)
        joined = time.perf_counter()
        torch.manual_seed(cfg.seed)  # LoRA's random initialisation must be the same on every worker
        sharded = resume / checkpoint.SHARDED_DIR if resume is not None else None
        # a version without its sharded state (its trainer stopped before writing it): its engine's files
        from_files = resume if sharded is not None and not sharded.is_dir() else None
        self.model = checkpoint.build_model(base_dir, cfg, from_files).to(self.device)
        if cfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.torch_compile:
            compile_layers(self.model)
        self.policy = self._shard(SampledLogits(self.model))
        # not fused: the fused CPU kernel does not take FSDP's sharded (DTensor) parameters
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr,
                                           weight_decay=cfg.weight_decay)
        self.reference = self._reference(base_dir) if cfg.kl_coef > 0 else None
        if sharded is not None and sharded.is_dir():
            checkpoint.load_sharded(sharded, self.model, self.optimizer)
        elif from_files is not None and self.rank == 0:
            log.warning("%s holds no optimizer state: its weights go on with fresh optimizer moments", resume)
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        return {"process_group_s": joined - started, "setup_s": time.perf_counter() - started,
                "node_id": ray.get_runtime_context().get_node_id(), **memory.state_bytes(self.model, self.optimizer)}

    def _shard(self, policy: SampledLogits) -> SampledLogits:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device, (self.world,))
        precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if self.cfg.dtype == "bfloat16" else None,
                                         reduce_dtype=torch.float32)
        for layer in policy.model.get_decoder().layers:
            fully_shard(layer, mesh=mesh, mp_policy=precision)
        fully_shard(policy, mesh=mesh, mp_policy=precision)
        return policy

    def _reference(self, base_dir: Path) -> SampledLogits:
        from transformers import AutoModelForCausalLM

        reference: Any = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        reference = reference.to(self.device)
        return self._shard(SampledLogits(reference)).eval().requires_grad_(False)

    def step(self, samples: list[Sample], advantages: list[float], share: BatchShare) -> dict[str, Any]:
        figures = train_step(self.policy, self.optimizer, StepInputs(samples, advantages), self.cfg, self.pad_id,
                             self.reference, share)
        return {**figures, "memory": memory.figures(self.model, self.optimizer, self.device)}

    def save_state(self, path: Path) -> None:
        """Every worker writes its shards of the trainable weights and the optimizer (never gathered). Not in
        the background as the local backend does: a write thread's collectives would race the next step's on
        the same process group."""
        checkpoint.save_sharded(path, self.model, self.optimizer)

    def save(self, path: Path, merged: bool) -> None:
        """The engine's files, gathered on rank 0: the model only, and for an unmerged adapter only the
        adapter."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True,
                                   ignore_frozen_params=self.cfg.lora and not merged)
        weights = get_model_state_dict(self.model, options=options)
        if self.rank == 0:
            checkpoint.save_weights(self.model, path, weights, self.cfg, merged=merged)
        dist.barrier()

    def served_weights(self, merged: bool) -> dict[str, torch.Tensor] | None:
        """The weights the engine serves (as `save` writes them), gathered in full on rank 0; None on the other
        ranks, which take part in the gather."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(self.model, options=options)
        return checkpoint.served_weights(self.model, weights, self.cfg, merged=merged) if self.rank == 0 else None

    def logprobs(self, token_ids: list[int]) -> list[float]:
        """Every worker runs the forward (it gathers sharded parameters collectively); all get the same."""
        return token_logprobs(self.policy, token_ids)

    def weights(self) -> dict[str, Any]:
        """The full trainable state on rank 0 (tests compare it with the local backend's)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        return get_model_state_dict(self.model, options=options)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _gloo_on_node_address() -> None:
    """Have gloo talk over the interface that holds Ray's address for this node.

    Left alone, gloo binds to the address this machine's hostname resolves to, which on many hosts
    (Debian's /etc/hosts among them) is a loopback address: peers on other nodes would be told to
    connect to 127.0.x.1 and the process group would never form. A GLOO_SOCKET_IFNAME the user set
    wins; without psutil (peft and accelerate bring it) or a matching interface, gloo's own choice stays.
    """
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    import ray

    try:
        import psutil
    except ImportError:
        return
    address = ray.util.get_node_ip_address()
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return
