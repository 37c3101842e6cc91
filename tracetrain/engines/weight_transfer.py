"""A version's full weights sent into a running vLLM from the trainer's memory, without a trip through disk.

vLLM (0.26 on, dev mode) takes new weights over HTTP through the weight-transfer engine of its workers:
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`. The
transport is the server's `--weight-transfer-config` backend:
- `ipc` (vLLM's own, trainer and vLLM on one GPU): CUDA IPC handles of the trainer's tensors; vLLM maps
  the same GPU memory and loads from it, as verl and OpenRLHF do.
- `tracetrain_shm` (engines/vllm_shm_transfer.py, vLLM on CPU): the tensors are written into one file under
  /dev/shm, which is memory, and each worker maps it.

The publisher (engines/vllm_publish.py) still finds every version on disk: the checkpoint is written for
resuming, and a reload from it is the fallback when a transfer fails, and the route between machines.
"""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import tempfile
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
import torch

from tracetrain.engines.publishing import PublishError

SHARED_MEMORY = "tracetrain_shm"
CUDA_IPC = "ipc"
ALIGN = 64
"""Every tensor starts at a multiple of this in the shared file: a view as any dtype needs its size's."""


BACKENDS = {"shm": SHARED_MEMORY, "ipc": CUDA_IPC}
"""`train.weight_transfer` -> vLLM's backend name."""


def server_config(setting: str) -> tuple[list[str], dict[str, str]]:
    """vLLM's flags and environment for `train.weight_transfer: shm|ipc`. IPC handles travel pickled over
    HTTP, which vLLM accepts only when told to (the servers started here listen on a private socket)."""
    backend = BACKENDS[setting]
    args = ["--weight-transfer-config", f'{{"backend": "{backend}"}}']
    return args, ({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if backend == CUDA_IPC else {})


async def send(client: httpx.AsyncClient, weights: Iterable[tuple[str, torch.Tensor]], backend: str) -> None:
    """Load `weights` into the (paused) vLLM behind `client`; raises PublishError with vLLM's reason. The
    tensors are packed on a thread: writing a model into the shared file would stall the gateway's loop."""
    await _post(client, "/init_weight_transfer_engine", {"init_info": {}})
    await _post(client, "/start_weight_update", None)
    pack = _shared_file if backend == SHARED_MEMORY else _ipc_handles
    update_info, release = await asyncio.to_thread(pack, weights)
    try:
        await _post(client, "/update_weights", {"update_info": update_info})
        await _post(client, "/finish_weight_update", None)
    finally:
        release()


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any] | None) -> None:
    try:
        response = await client.post(path, json=body)
    except httpx.HTTPError as exc:
        raise PublishError(f"weight transfer {path}: {type(exc).__name__}: {exc}") from exc
    if response.status_code == 404:
        raise PublishError(f"vLLM has no {path}: start it in dev mode with --weight-transfer-config")
    if response.status_code != 200:
        raise PublishError(f"vLLM refused the weight transfer at {path} ({response.status_code}): "
                           f"{response.text[:500]}")


def _shared_file(weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict[str, Any], Callable[[], None]]:
    """Every tensor's bytes in one file under /dev/shm; releasing removes it."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = root / f"tracetrain-weights-{uuid.uuid4().hex}"
    names: list[str] = []
    dtype_names: list[str] = []
    shapes: list[list[int]] = []
    offsets: list[int] = []
    try:
        with path.open("wb") as file:
            os.chmod(path, 0o600)
            for name, tensor in weights:
                if padding := -file.tell() % ALIGN:
                    file.write(b"\0" * padding)
                offsets.append(file.tell())
                names.append(name)
                dtype_names.append(str(tensor.dtype).removeprefix("torch."))
                shapes.append(list(tensor.shape))
                data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                file.write(data.numpy().data)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    info = {"path": str(path), "names": names, "dtype_names": dtype_names, "shapes": shapes, "offsets": offsets}
    return info, lambda: path.unlink(missing_ok=True)


def _ipc_handles(weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict[str, Any], Callable[[], None]]:
    """CUDA IPC handles of the tensors, keyed by the GPU's UUID as vLLM's `ipc` backend expects. A handle does
    not keep its memory alive: the tensors are held until releasing, after vLLM has loaded from them."""
    from torch.multiprocessing.reductions import reduce_tensor

    held: list[torch.Tensor] = []
    names: list[str] = []
    dtype_names: list[str] = []
    shapes: list[list[int]] = []
    handles: list[dict[str, Any]] = []
    for name, tensor in weights:
        if not tensor.is_cuda:
            raise PublishError(f"CUDA IPC needs the weights on the GPU; {name} is on {tensor.device}")
        gpu = str(torch.cuda.get_device_properties(tensor.device).uuid)
        weight = tensor.detach().contiguous()
        held.append(weight)
        names.append(name)
        dtype_names.append(str(weight.dtype).removeprefix("torch."))
        shapes.append(list(weight.shape))
        handles.append({gpu: reduce_tensor(weight)[1]})
    info = {"names": names, "dtype_names": dtype_names, "shapes": shapes,
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}

    def release() -> None:
        held.clear()
        torch.cuda.ipc_collect()

    return info, release
