"""Prometheus metrics of the gateway, on a registry of its own so several apps can live in one process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tracetrain_requests", "Chat requests by outcome", ["status", "stream"], registry=self.registry
        )
        self.latency = Histogram(
            "tracetrain_request_seconds",
            "Time from request to last byte",
            ["stream"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.tokens = Counter("tracetrain_tokens", "Tokens by kind", ["kind"], registry=self.registry)
        self.sessions = Counter("tracetrain_sessions_created", "Sessions created", registry=self.registry)
        self.rewards = Counter("tracetrain_rewards", "Reward events stored", registry=self.registry)
        self.queue_depth = Gauge(
            "tracetrain_store_queue_depth", "Writes waiting for the group-commit writer", registry=self.registry
        )
        self.policy_version = Gauge(
            "tracetrain_policy_version", "Policy version being served", registry=self.registry
        )
        self.admission_held = Gauge(
            "tracetrain_admission_held", "New sessions waiting for admission now", registry=self.registry
        )
        self.admission_refused = Counter(
            "tracetrain_admission_refused", "New sessions refused with 429 after waiting", registry=self.registry
        )
