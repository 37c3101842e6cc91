"""Capture quality (admin): how often calls extended their session's token chain exactly, why new
segments began, and which finished sessions the trainer left unconsumed, per model and API key."""

from __future__ import annotations

from collections import Counter

from fastapi import APIRouter

from tracetrain.proxy.auth import AdminDep
from tracetrain.proxy.console_protocol import CaptureRow, CaptureStats
from tracetrain.proxy.gateway import GatewayDep
from tracetrain.proxy.openapi import error_responses
from tracetrain.store import console

router = APIRouter(responses=error_responses(401, 403))


def _total(rows: list[CaptureRow]) -> CaptureRow:
    starts: Counter[str] = Counter()
    aside: Counter[str] = Counter()
    for row in rows:
        starts.update(row.segment_starts)
        aside.update(row.set_aside)
    calls, chained = sum(r.calls for r in rows), sum(r.chained for r in rows)
    later = calls - starts.get("start", 0)
    return CaptureRow(model=None, owner=None, calls=calls, chained=chained,
                      chained_share=chained / later if later else None,
                      segment_starts=dict(sorted(starts.items())), set_aside=dict(sorted(aside.items())))


@router.get("/v1/stats/capture", response_model=CaptureStats)
async def capture(gw: GatewayDep, _: AdminDep) -> CaptureStats:
    stats = await gw.read(console.capture_stats)
    rows = [CaptureRow.model_validate(row) for row in stats["data"]]
    return CaptureStats(total=_total(rows), data=rows)
