"""The fsdp backend joining a real two-node Ray cluster (`train.ray_address`), both nodes on this machine.

`ray start --head` and `ray start --address=…` run as separate processes, each node offering one CPU and
its own custom resource, so the two workers' one-CPU bundles cannot share a node. The trainer connects
the way `tracetrain train --set ray_address=…` does: through `TrainConfig.ray_address`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tracetrain.trainer.backend import StepBatch

ray = pytest.importorskip("ray", reason="the distributed extra (Ray) is not installed")

from tests.support.fsdp_step import (  # noqa: E402
    WEIGHT_TOLERANCE,
    assert_same_step,
    local_backend,
    max_difference,
    train_config,
    trainable,
    trajectories,
)
from tests.support.servers import free_port  # noqa: E402
from tracetrain.trainer.fsdp_backend import FSDPBackend  # noqa: E402

pytestmark = pytest.mark.slow

RAY = Path(sys.executable).parent / "ray"
NODE_RESOURCES = ("node_a", "node_b")
"""The custom resource each node offers (head first): it names the node a worker landed on."""
STARTUP_TIMEOUT_S = 120.0


@dataclass
class RayCluster:
    address: str
    """The head's GCS address, as `ray start --address` and `ray_address` take it."""
    logs: list[Path]
    """Each `ray start`'s output, for a failure's message."""

    def log_tails(self) -> str:
        return "\n".join(f"--- {log}\n{log.read_text(errors='replace')[-2000:]}" for log in self.logs if log.exists())


def _start_node(root: Path, name: str, head_address: str | None) -> tuple[subprocess.Popen[bytes], Path]:
    """`ray start --block` for one node, in its own session so that its process group holds every process
    this node starts (GCS on the head, raylet, their children) and teardown reaches them and nothing else.
    Every port is chosen here: the defaults (the agent's, the client server's) are fixed numbers that
    another Ray on this machine may hold."""
    temp_dir = root / name
    command = [str(RAY), "start", "--block", "--num-cpus=1", "--num-gpus=0",
               f'--resources={{"{name}": 1}}', f"--temp-dir={temp_dir}", "--object-store-memory=200000000",
               "--disable-usage-stats", f"--dashboard-agent-listen-port={free_port()}",
               f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
               f"--metrics-export-port={free_port()}"]
    if head_address is None:
        # the dashboard process runs even when not included (it serves the jobs API), on a fixed port
        command += ["--head", f"--port={free_port()}", "--include-dashboard=false", f"--dashboard-port={free_port()}",
                    f"--ray-client-server-port={free_port()}"]
    else:
        command += [f"--address={head_address}"]
    # No drain on SIGTERM: it gives running work time to finish elsewhere, and this cluster's work is done.
    # A worker process that imports torch on a busy 2-core machine (the whole suite running) can take longer
    # to register than Ray's default allows, and its actor is then cancelled before it ever runs.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
           "RAY_worker_register_timeout_seconds": "600"}
    log = root / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return process, log


def _stop_nodes(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to each `ray start --block` (it then stops its node's processes in order), then SIGKILL to
    whatever is left of its process group. Not `ray stop`: it would stop every Ray on this machine."""
    for process in reversed(processes):  # the worker node first, while its head still answers
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        with contextlib.suppress(ProcessLookupError):  # raised when the group is empty: all stopped
            os.killpg(process.pid, signal.SIGKILL)


def _wait_for_nodes(cluster: RayCluster, processes: list[subprocess.Popen[bytes]], count: int) -> None:
    """Until the cluster reports `count` live nodes; fails with the nodes' logs if one exits."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
    try:
        while len([n for n in ray.nodes() if n["Alive"]]) < count:
            assert all(p.poll() is None for p in processes), cluster.log_tails()
            assert time.monotonic() < deadline, cluster.log_tails()
            time.sleep(0.5)
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """Two Ray nodes on this machine, as separate `ray start` processes (head: node_a, worker: node_b)."""
    # A short root: Ray's Unix sockets live under it, and a socket path has a limit of about 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="tt-ray-", dir="/tmp"))
    processes: list[subprocess.Popen[bytes]] = []
    with pytest.MonkeyPatch.context() as env:
        # no auth token written under the home directory: this cluster lives only for this module
        env.setenv("RAY_AUTH_MODE", "disabled")
        try:
            head, head_log = _start_node(root, NODE_RESOURCES[0], None)
            processes.append(head)
            cluster = RayCluster("", [head_log])
            written = root / NODE_RESOURCES[0] / "ray_current_cluster"  # the head writes its address here
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not (written.exists() and written.read_text().strip()):
                assert head.poll() is None and time.monotonic() < deadline, cluster.log_tails()
                time.sleep(0.2)
            cluster.address = written.read_text().strip()
            worker, worker_log = _start_node(root, NODE_RESOURCES[1], cluster.address)
            processes.append(worker)
            cluster.logs.append(worker_log)
            _wait_for_nodes(cluster, processes, len(NODE_RESOURCES))
            yield cluster
        finally:
            if ray.is_initialized():
                ray.shutdown()
            _stop_nodes(processes)
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_fsdp_step_on_two_ray_nodes_equals_one_local_step(ray_cluster: RayCluster, tiny_model_path: Path,
                                                               tmp_path: Path, lora: bool) -> None:
    """Joined through `ray_address`, the backend places its two workers on the cluster's two nodes (one
    each: every node has one CPU), rank 0's rendezvous address is the one Ray reports for rank 0's node,
    and the step is the local backend's, full and LoRA: figures to a relative 1e-5, every weight within
    lr * 1e-2 (test_fsdp.py derives both tolerances; gloo reduces in the same way whether or not the
    ranks share a node)."""
    samples, advantages = trajectories()
    local = local_backend(train_config(tmp_path, lora=lora), tiny_model_path)
    local_figures = local.step(StepBatch(samples, advantages))
    expected = trainable(local)

    assert not ray.is_initialized()
    try:
        fsdp = FSDPBackend(train_config(tmp_path, lora=lora, backend="fsdp", workers=2,
                                        ray_address=ray_cluster.address), tiny_model_path, None)
    except Exception as exc:  # the nodes' own logs say why a worker did not start
        raise AssertionError(f"the backend did not start on the cluster: {exc}\n{ray_cluster.log_tails()}") from exc
    try:
        assert fsdp.owns_ray, "the backend joined the cluster itself, from cfg.ray_address"
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        figures = fsdp.step(StepBatch(samples, advantages))
        actual = fsdp.weights()
    finally:
        fsdp.close()

    assert len(nodes) == len(NODE_RESOURCES), "the cluster is the fixture's two nodes"
    placed = [next(r for r in NODE_RESOURCES if r in nodes[node]["Resources"]) for node in fsdp.nodes]
    assert sorted(placed) == sorted(NODE_RESOURCES), f"one worker on each node, got {placed}"
    assert fsdp.master[0] == nodes[fsdp.nodes[0]]["NodeManagerAddress"], "rendezvous at rank 0's node address"
    assert figures["micro_batches"] > 1 and len(set(figures["worker_tokens"])) > 1
    assert_same_step(local_figures, figures)
    difference = max_difference(expected, actual)
    print(f"max |fsdp on two nodes - local| after one step ({'lora' if lora else 'full'}): {difference:.3g}")
    assert difference < WEIGHT_TOLERANCE
