"""Prometheus metrics of one replica, in a registry of its own.

One registry per app (not the process-global default) so several replicas, or
several test apps, can live in one process without clashing metric names.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Seconds: hot-loads range from sub-second deltas to minutes-long anchors.
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
#: Seconds: the pause should be milliseconds; anything near a second is a regression to see.
PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The metrics a replica exports at ``GET /metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.policy_version = Gauge(
            "ckptdelta_policy_version", "Policy version being served (-1 when unknown).", registry=r)
        self.policy_version.set(-1)
        self.hotload_duration = Histogram(
            "ckptdelta_hotload_duration_seconds", "Wall time of a hot-load, request to READY.",
            buckets=DURATION_BUCKETS, registry=r)
        self.hotload_pause = Histogram(
            "ckptdelta_hotload_pause_seconds", "Time serving was paused to swap weights.",
            buckets=PAUSE_BUCKETS, registry=r)
        self.bytes_fetched = Counter(
            "ckptdelta_hotload_bytes_fetched", "Bytes fetched from storage by hot-loads.", registry=r)
        self.hotloads = Counter(
            "ckptdelta_hotloads", "Hot-loads by result (ready, failed, noop, superseded, cancelled).", ["result"], registry=r)
        self.requests = Counter(
            "ckptdelta_requests", "HTTP requests by endpoint and status code.", ["endpoint", "status"], registry=r)
        self.generated_tokens = Counter(
            "ckptdelta_generated_tokens", "Tokens sampled by completion requests.", registry=r)
        self.request_crossed_swap = Counter(
            "ckptdelta_requests_crossed_swap", "Sampling requests whose steps ran under more than one version.",
            registry=r)

    def set_version(self, version: int | None) -> None:
        self.policy_version.set(-1 if version is None else version)

    def render(self) -> bytes:
        return generate_latest(self.registry)
