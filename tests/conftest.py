from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.servers import PostgresCluster, RunningGateway, start_gateway
from tests.support.setup_steps import POSTGRES_MISSING, TORCH_MISSING

if TYPE_CHECKING:
    from tracetrain.engines.transformers_engine import TransformersEngine

# Every Ray the suite starts runs without Ray's token authentication. The first Ray started in this process
# otherwise writes a token under the home directory and keeps using it, and a later driver connection to a
# cluster started without one (tests/integration/test_fsdp_ray_cluster.py) has its actors cancelled
# before they run.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# tests.support.ci_skips fails every skip when CI=true (a skip there means a setup step is missing);
# pytester runs that plugin in tests/unit/test_ci_skips.py. pytest_plugins is only allowed in the
# top conftest, hence here.
pytest_plugins = ["pytester", "tests.support.ci_skips"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` (tests/gpu/) need a CUDA device. Where torch sees none, or is not installed, they
    are deselected rather than skipped: a machine without a GPU is the normal case, not a missing setup
    step, and tests.support.ci_skips fails every skip in CI.

    Every test that needs vLLM (marked `vllm`, or using the shared `vllm_server`) is also `slow`: starting
    vLLM and generating on CPU is what makes them slow, so the quick tier (`-m "not slow"`) leaves out a
    new vLLM test without anyone having to remember to mark it."""
    for item in items:
        if item.get_closest_marker("vllm") or "vllm_server" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu or _cuda_available():
        return
    config.hook.pytest_deselected(items=gpu)
    items[:] = [item for item in items if not item.get_closest_marker("gpu")]


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """A tiny random Llama with SmolLM2's tokenizer (built once, cached under ~/.cache/tracetrain)."""
    pytest.importorskip("torch", reason=TORCH_MISSING)
    from tracetrain.engines.models import tiny_model_dir

    return tiny_model_dir()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from tracetrain.engines.models import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresCluster]:
    """The shared test cluster. It runs with fsync=off: the store tests check behaviour, not
    survival of a power cut, and fsync on a busy CI disk would only slow them down."""
    if not PostgresCluster.available():
        pytest.skip(POSTGRES_MISSING)
    cluster = PostgresCluster()
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def durable_postgres() -> Iterator[PostgresCluster]:
    """A cluster with production durability (fsync=on, synchronous_commit=on), for the durability
    test only: a commit it acknowledges is on disk, as it would be in a real deployment."""
    if not PostgresCluster.available():
        pytest.skip(POSTGRES_MISSING)
    cluster = PostgresCluster(durable=True)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty store: a SQLite file, or a new database in the test PostgreSQL cluster."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    cluster: PostgresCluster = request.getfixturevalue("postgres")
    return cluster.create_database(f"t_{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_path: Path) -> TransformersEngine:
    from tracetrain.engines.transformers_engine import TransformersEngine

    return TransformersEngine(tiny_model_path, model_name="tiny")


@pytest.fixture
def gateway(tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    """A real gateway over HTTP in front of the in-process tiny model, with a SQLite store."""
    from tests.support.recording import RecordingEngine

    running = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path / 'gw.db'}")
    yield running
    running.stop()


@pytest.fixture(scope="session")
def tool_model_path() -> Path:
    """A tiny model trained to call the `add` tool on a scripted question (see tests/support/tool_model.py)."""
    from tests.support.tool_model import tool_model_dir

    return tool_model_dir()


@pytest.fixture(scope="module")
def tool_engine(tool_model_path: Path) -> TransformersEngine:
    from tracetrain.engines.transformers_engine import TransformersEngine

    return TransformersEngine(tool_model_path, model_name="tool-tiny")


@pytest.fixture
def tool_gateway(tool_engine: TransformersEngine, tool_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    """A real gateway in front of the tool-calling tiny model, recording what the engine sees."""
    from tests.support.recording import RecordingEngine

    running = start_gateway(RecordingEngine(tool_engine), tool_model_path, f"sqlite:///{tmp_path / 'tool.db'}")
    yield running
    running.stop()
