"""The shared-memory file of a weight transfer (engines/weight_transfer.py): every tensor comes back from it
exactly, whatever its dtype and shape, at an offset a view of its dtype accepts, and the file goes away.

The reader here is written independently of vLLM's side (engines/vllm_shm_transfer.py, which imports vLLM and
is exercised against the real CPU vLLM in tests/integration/test_publish.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.setup_steps import TORCH_MISSING

torch = pytest.importorskip("torch", reason=TORCH_MISSING)

from tracetrain.engines.weight_transfer import ALIGN, _shared_file  # noqa: E402


def read_back(info: dict, index: int) -> torch.Tensor:
    dtype = getattr(torch, info["dtype_names"][index])
    shape = info["shapes"][index]
    count = int(torch.tensor(shape).prod().item()) if shape else 1
    with open(info["path"], "rb") as file:
        file.seek(info["offsets"][index])
        raw = bytearray(file.read(count * torch.empty((), dtype=dtype).element_size()))
    return torch.frombuffer(raw, dtype=dtype).reshape(shape)


def test_every_tensor_comes_back_exactly_and_the_file_is_removed() -> None:
    generator = torch.Generator().manual_seed(0)
    weights = {
        "a.weight": torch.randn(3, 5, generator=generator),  # 60 bytes: the next one needs padding
        "b.weight": torch.randn(7, generator=generator).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "c.bias": torch.randn(4, 2, generator=generator).t(),  # not contiguous
        "ids": torch.arange(5, dtype=torch.int32),
    }
    info, release = _shared_file(weights.items())
    assert info["names"] == list(weights)
    assert all(offset % ALIGN == 0 for offset in info["offsets"])
    for index, (name, tensor) in enumerate(weights.items()):
        back = read_back(info, index)
        assert back.dtype == tensor.dtype and back.shape == tensor.shape, name
        assert torch.equal(back, tensor), name
    release()
    assert not Path(info["path"]).exists()


def test_a_failure_while_writing_leaves_no_file(tmp_path: Path) -> None:
    def weights():
        yield "ok", torch.ones(2)
        raise RuntimeError("the trainer's tensors went away")

    before = set(Path("/dev/shm").glob("tracetrain-weights-*")) if Path("/dev/shm").is_dir() else set()
    with pytest.raises(RuntimeError, match="went away"):
        _shared_file(weights())
    after = set(Path("/dev/shm").glob("tracetrain-weights-*")) if Path("/dev/shm").is_dir() else set()
    assert after == before
