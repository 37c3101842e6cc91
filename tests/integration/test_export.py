"""`tracetrain export` writes trajectories that TRL or verl can load: JSONL and Parquet."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
from openai import OpenAI

from tests.support.servers import RunningGateway
from tests.support.tool_model import GREETING


def _record_a_session(gw: RunningGateway) -> None:
    client = OpenAI(base_url=gw.v1("exp-1"), api_key="unused")
    messages: list[Any] = [{"role": "user", "content": GREETING[0]}]
    reply = client.chat.completions.create(model="tool-tiny", messages=messages, temperature=0, max_tokens=6)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "ok"}]
    client.chat.completions.create(model="tool-tiny", messages=messages, temperature=0, max_tokens=4)
    httpx.post(f"{gw.url}/v1/rewards", json={"session_id": "exp-1", "reward": {"correct": 1.0, "style": 0.5},
                                              "final": True}).raise_for_status()


def _export(gw: RunningGateway, fmt: str, out: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "tracetrain.cli", "export", "--db-url", str(gw.gateway.db.url),
         "--format", fmt, "--out", str(out)], capture_output=True, text=True, check=True)
    return result.stdout


def test_jsonl_and_parquet_hold_the_trajectory(tool_gateway: RunningGateway, tmp_path: Path) -> None:
    _record_a_session(tool_gateway)
    trajectory = httpx.get(f"{tool_gateway.url}/v1/sessions/exp-1/trajectory").json()
    segment = trajectory["trajectories"][0]["segments"][0]

    assert "wrote 1 trajectory segments" in _export(tool_gateway, "jsonl", tmp_path / "t.jsonl")
    (row,) = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert row["input_ids"] == segment["token_ids"]
    assert row["loss_mask"] == segment["loss_mask"]
    assert row["reward"] == 1.5 and row["final"] is True
    assert row["prompt"][-1] == {"role": "user", "content": "ok"}

    _export(tool_gateway, "parquet", tmp_path / "t.parquet")
    table = pq.read_table(tmp_path / "t.parquet").to_pylist()
    assert table[0]["input_ids"] == segment["token_ids"]
    assert table[0]["logprobs"] == row["logprobs"]
