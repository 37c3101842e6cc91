"""The vLLM server the gateway starts is reachable by the gateway alone: its HTTP API (with the
development endpoints `/pause`, `/collective_rpc` and LoRA loading, which vLLM's `--api-key` does not
guard) listens on a Unix socket in a directory only this user may enter and on no TCP port, and
generation and LoRA publishing both go through that socket; vLLM's internal ZeroMQ sockets live in
that directory too. Uses the session's shared server, started by `VLLMServer` as `tracetrain serve`
starts it.

What does stay on TCP: vLLM's worker process sets up torch.distributed with the gloo backend even for
a world size of 1, and gloo's TCP transport listens on a loopback port per process group (13 on the
vLLM 0.32 CPU build). They carry collectives between ranks, not HTTP, and vLLM offers no way to turn
them off; the test pins them to the worker and to loopback, so any other listener fails it.
"""

from __future__ import annotations

import ipaddress
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import RunningVLLM
from tests.support.servers import RunningGateway, start_gateway
from tracetrain.engines.vllm import VLLMEngine
from tracetrain.engines.vllm_publish import VLLMLoRAPublisher

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::ResourceWarning")]


def process_group(pgid: int) -> list[int]:
    """Every process in the group: the API server, its engine core and its workers."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # Fields after the command name, which is in parentheses and may hold spaces.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in (Path("/proc") / str(pid) / "fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def listening_tcp_inodes() -> dict[str, tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """inode -> (address, port) of every TCP socket in LISTEN state, IPv4 and IPv6."""
    listening = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A":  # TCP_LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # the kernel prints each 32-bit word in host (little-endian) order
                ordered = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                listening[fields[9]] = (ipaddress.ip_address(ordered), int(port, 16))
    return listening


def listening_unix_paths(inodes: set[str]) -> set[str]:
    """The paths of the listening Unix sockets among `inodes`."""
    paths = set()
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            # Flags 00010000 is __SO_ACCEPTCON: a listening socket.
            if len(fields) >= 8 and fields[6] in inodes and int(fields[3], 16) & 0x10000:
                paths.add(fields[7])
    return paths


@pytest.fixture
def publishing_gateway(vllm_server: RunningVLLM, smollm2_path: Path,
                       tmp_path: Path) -> Iterator[tuple[RunningGateway, VLLMLoRAPublisher]]:
    engine = VLLMEngine(vllm_server.url, vllm_server.model_name, timeout=120)
    publisher = VLLMLoRAPublisher(engine, prefix="exposure")
    running = start_gateway(engine, smollm2_path, f"sqlite:///{tmp_path / 'store.db'}", publisher=publisher)
    yield running, publisher
    running.stop()


def test_self_started_vllm_listens_on_a_private_socket_only(
    vllm_server: RunningVLLM, publishing_gateway: tuple[RunningGateway, VLLMLoRAPublisher], smollm2_path: Path,
    tmp_path: Path,
) -> None:
    server = vllm_server.server
    if server is None or server.process is None:
        pytest.skip("TRACETRAIN_TEST_VLLM_URL names a server this session did not start")
    assert server.socket_path is not None and vllm_server.url == f"unix:{server.socket_path}"

    # The HTTP API on no TCP port: the API server and the engine core listen on none, and the worker's
    # listeners are gloo's, on loopback (see the module's docstring).
    group = process_group(server.process.pid)
    assert len(group) >= 3, group  # the API server, its engine core and a worker at least
    listening = listening_tcp_inodes()
    for pid in group:
        name = (Path("/proc") / str(pid) / "comm").read_text().strip()
        tcp = [listening[inode] for inode in socket_inodes(pid) if inode in listening]
        if name.startswith("VLLM::Worker"):
            assert all(address.is_loopback for address, _ in tcp), tcp
        else:
            assert not tcp, f"{name} (pid {pid}) listens on TCP {tcp}"
    assert str(server.socket_path) in listening_unix_paths(socket_inodes(server.process.pid))
    # So do the ZeroMQ sockets between vLLM's own processes (the engine core takes utility calls there).
    private = server.socket_path.parent
    unix = set().union(*(listening_unix_paths(socket_inodes(pid)) for pid in group))
    assert len(unix) > 1 and all(Path(path).parent == private for path in unix), unix

    # The socket's directory: this user's, and no one else may enter it.
    directory = private.stat()
    assert stat.S_IMODE(directory.st_mode) == 0o700 and directory.st_uid == os.getuid()

    # A call through the gateway and a LoRA publish, both over the socket.
    gateway, publisher = publishing_gateway
    model = gateway.gateway.config.engine.served_model_name
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    first = httpx.post(f"{gateway.v1('exposure-0')}/chat/completions", json=body, timeout=120)
    assert first.status_code == 200, first.text
    assert first.headers["x-policy-version"] == "0"

    from tests.integration.test_publish import load_model, save_lora

    adapter = save_lora(load_model(smollm2_path), tmp_path / "lora", seed=3)
    published = httpx.post(f"{gateway.url}/v1/policies", headers={"Authorization": "Bearer unused"}, timeout=120,
                           json={"version": 1, "checkpoint": str(adapter), "kind": "lora"})
    assert published.status_code == 200, published.text
    assert publisher.loaded == ["exposure-v1"]
    second = httpx.post(f"{gateway.v1('exposure-1')}/chat/completions", json=body, timeout=120)
    assert second.status_code == 200, second.text
    assert second.headers["x-policy-version"] == "1"
