"""The console's own JSON: who the caller is (`/v1/whoami`), and the overview of the gateway, its store
and the trainer (`/v1/overview`, admin). The console pages read only documented endpoints like these."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter
from prometheus_client import Counter
from sqlmodel import Session

from tracetrain.engines.publishing import line_version
from tracetrain.proxy.auth import AdminDep, CallerDep
from tracetrain.proxy.console_protocol import LastPublish, Overview, TrafficCounters, TrainerState, WhoAmI
from tracetrain.proxy.gateway import Gateway, GatewayDep
from tracetrain.proxy.openapi import error_responses
from tracetrain.proxy.policy_lines import PolicyQuery, scoped_policy
from tracetrain.store import console, leases, policy_lines
from tracetrain.store.models import DEFAULT_POLICY

router = APIRouter()


@router.get("/v1/whoami", response_model=WhoAmI, responses=error_responses(401))
async def whoami(gw: GatewayDep, caller: CallerDep) -> WhoAmI:
    """The caller's key fingerprint, whether it is the admin key, and the policy it is bound to."""
    return WhoAmI(owner=caller.owner, admin=caller.admin, keys_required=not gw.keys.open, policy=caller.policy)


def _count(counter: Counter, **labels: str) -> int:
    """A counter's total over every label set that matches `labels`."""
    return int(sum(sample.value for metric in counter.collect() for sample in metric.samples
                   if sample.name.endswith("_total") and all(sample.labels.get(k) == v for k, v in labels.items())))


def _counters(gw: Gateway) -> TrafficCounters:
    m = gw.metrics
    requests = _count(m.requests)
    return TrafficCounters(requests=requests, failed_requests=requests - _count(m.requests, status="200"),
                           prompt_tokens=_count(m.tokens, kind="prompt"),
                           completion_tokens=_count(m.tokens, kind="completion"),
                           sessions_created=_count(m.sessions), rewards=_count(m.rewards))


@router.get("/v1/overview", response_model=Overview, responses=error_responses(
    401, 403, 404, described={404: "No such policy"}))
async def overview(gw: GatewayDep, caller: AdminDep, policy: PolicyQuery = None) -> Overview:
    """Traffic counters of this gateway process, sessions by status, the served version, the trainer's
    state and the newest version's publish; with `policy`, the sessions, versions and trainer counts are
    that policy's (the traffic counters and the trainer's holders stay the whole gateway's)."""
    only = await scoped_policy(gw.policies, caller, policy)

    def read(db: Session) -> tuple[dict[str, int], int, int, Any, list[str]]:
        return (console.status_counts(db, policy=only), leases.ready_count(db, policy=only),
                leases.leased_count(db, policy=only), leases.latest_policy(db, line=only or DEFAULT_POLICY),
                [only] if only else policy_lines.names(db))

    statuses, ready, leased, latest, lines = await gw.read(read)
    holders = gw.holds.holders
    state: Literal["held", "stepping", "waiting"] = "held" if holders else "stepping" if leased else "waiting"
    trained = latest is not None and latest.version > 0
    return Overview(
        time=time.time(), counters=_counters(gw), store_queue_depth=gw.writer.queue_depth,
        policy=only, served_version=line_version(gw.engine, only or DEFAULT_POLICY),
        served_versions={name: line_version(gw.engine, name) for name in lines},
        sessions={"open": statuses.get("open", 0), "final": statuses.get("final", 0)},
        trainer=TrainerState(state=state, ready=ready, leased=leased, holders=holders,
                             last_step_at=latest.created_at if trained else None),
        last_publish=LastPublish(version=latest.version, published_at=latest.published_at,
                                 seconds=latest.metrics.get("publish_seconds"), error=latest.publish_error)
        if trained else None)
