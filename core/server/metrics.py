"""The server's Prometheus metrics, on a registry of its own (so two servers in one process never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Requests by endpoint and status, token counts, accepted tokens per step, latency histograms, and the
    queue's depth and the rows in flight."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specpilot_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("specpilot_finished_requests", "generation requests ended, by finish reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("specpilot_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("specpilot_generation_tokens", "tokens generated", registry=r)
        self.accepted = Histogram("specpilot_accepted_tokens_per_step",
                                  "tokens one row gained in one step (accepted draft tokens and the bonus)",
                                  buckets=tuple(range(1, 17)), registry=r)
        self.ttft = Histogram("specpilot_time_to_first_token_seconds", "arrival to first generated token",
                              buckets=LATENCY, registry=r)
        self.itl = Histogram("specpilot_inter_token_latency_seconds",
                             "gap between a request's successive steps over the tokens the later one brought, "
                             "once per token", buckets=LATENCY, registry=r)
        self.queue = Gauge("specpilot_queue_depth", "requests accepted and waiting for a cache row", registry=r)
        self.running = Gauge("specpilot_requests_in_flight", "requests holding a cache row", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
