"""Full weights from a trainer's memory into vLLM on CPU: a vLLM weight-transfer backend over shared memory.

vLLM (0.26 on, dev mode) takes new weights over HTTP through a weight-transfer engine in each worker:
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`. Its own
backends move GPU memory (CUDA IPC, NCCL). This one moves host memory, for vLLM on CPU:
- the trainer's side (engines/weight_transfer.py) writes every tensor into one file under /dev/shm, which
  is memory (tmpfs), not disk;
- `update_weights` names the file and, per tensor, its name, dtype, shape and byte offset;
- each worker maps the file and hands the tensors to the model's own `load_weights`, between vLLM's
  layerwise-reload start and finish, as its CUDA IPC backend does.

It runs inside vLLM's processes, where `register` (a vLLM general plugin, declared in pyproject.toml) adds
it as the backend `tracetrain_shm`: it imports only vLLM, torch and the standard library.
"""

from __future__ import annotations

import contextlib
import mmap
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "tracetrain_shm"


def register() -> None:
    """vLLM's general-plugin hook: make `--weight-transfer-config '{"backend": "tracetrain_shm"}'` resolve."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # vLLM loads plugins once per process; a second load would find the backend registered
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "SharedMemoryWeightTransferEngine")


@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    """Nothing to agree on: the file and its layout come with each update."""


@dataclass
class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
    path: str
    """The file under /dev/shm holding every tensor's bytes."""
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    """Each tensor's first byte in the file."""


class SharedMemoryWeightTransferEngine(WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]):
    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        return None

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's version synchronizes the accelerator after loading, which raises where there is none (vLLM on
        # CPU); loading from host memory is done when `load_weights` returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
        if not update_info.names:
            return
        with open(update_info.path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
            buffer = memoryview(view)
            try:
                data = torch.frombuffer(buffer, dtype=torch.uint8)  # read-only: torch warns, nothing writes it
                weights = [(name, _tensor(data, offset, dtype, shape)) for name, dtype, shape, offset in
                           zip(update_info.names, update_info.dtype_names, update_info.shapes, update_info.offsets,
                               strict=True)]
                self.model.load_weights(weights)  # copies into the model's parameters
                del weights, data  # no view of the map may outlive it
            finally:
                buffer.release()

    def shutdown(self) -> None:
        return None


def _tensor(data: torch.Tensor, offset: int, dtype_name: str, shape: list[int]) -> torch.Tensor:
    dtype: Any = getattr(torch, dtype_name)
    count = 1
    for size in shape:
        count *= size
    length = count * torch.empty((), dtype=dtype).element_size()
    return data[offset : offset + length].view(dtype).view(shape)
