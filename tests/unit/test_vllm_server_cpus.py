"""A vLLM server started again by a pinned gateway (`gateway.cpus`) gets the CPUs the gateway had when it
made the server, not the gateway's own: the restart runs on the pinned event loop's thread."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading

import pytest

from tracetrain.engines.vllm_server import _start_child

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs Linux and two CPUs")


def test_a_child_started_from_a_pinned_thread_gets_the_cpus_captured_before() -> None:
    everything = os.sched_getaffinity(0)
    one = {min(everything)}
    seen: dict[str, str] = {}

    def pinned_thread() -> None:
        os.sched_setaffinity(0, one)  # this thread only, as the gateway pins its event loop's
        show = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
        seen["plain"] = subprocess.run(show, capture_output=True, text=True, check=True).stdout.strip()
        seen["server"] = subprocess.run(show, capture_output=True, text=True, check=True,
                                        preexec_fn=functools.partial(_start_child, everything)).stdout.strip()

    thread = threading.Thread(target=pinned_thread)
    thread.start()
    thread.join()
    assert seen == {"plain": str(sorted(one)), "server": str(sorted(everything))}
