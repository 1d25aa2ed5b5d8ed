"""The server's Prometheus metrics, on a registry of its own (so two servers in one process never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specpilot.core.engine.decode import PHASES

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Requests by endpoint and status, token counts, accepted tokens per step, latency histograms, what each
    step drafted, accepted and prefilled, its rows and those it drafted for, where the steps' time went (by
    phase, the drafter's catch-up and the owed tokens it fed included), the prefix cache's lookups and hits, the
    KV budget and what it holds, and the queue's depth and the rows in flight."""

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
        steps = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
        self.step_drafted = Histogram("specpilot_step_draft_tokens", "draft tokens one step verified, all rows",
                                      buckets=steps, registry=r)
        self.step_accepted = Histogram("specpilot_step_accepted_draft_tokens",
                                       "draft tokens one step accepted, all rows", buckets=steps, registry=r)
        self.step_prefilled = Histogram("specpilot_step_prefill_tokens",
                                        "prompt tokens one step prefilled (chunks of waiting prompts)",
                                        buckets=steps, registry=r)
        rows = (0, 1, 2, 4, 8, 12, 16, 24, 32, 64)
        self.step_rows = Histogram("specpilot_step_rows", "rows one step decoded", buckets=rows, registry=r)
        self.step_drafting = Histogram("specpilot_step_drafting_rows", "rows one step drafted for", buckets=rows,
                                       registry=r)
        self.step_seconds = Counter("specpilot_step_seconds", "seconds the engine's steps spent, by phase "
                                    "(core/engine/decode.py PHASES)", ["phase"], registry=r)
        for phase in PHASES:
            self.step_seconds.labels(phase)
        self.catch_up_tokens = Counter("specpilot_drafter_catch_up_tokens", "owed tokens fed to the drafter before "
                                       "steps that drafted (prompts it had not read, tokens emitted while it drafted "
                                       "nothing)", registry=r)
        self.prefix_queries = Counter("specpilot_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("specpilot_prefix_cache_hits", "prompt tokens found in the prefix cache (the hit "
                                   "rate is hits / queries)", registry=r)
        self.kv_budget = Gauge("specpilot_kv_cache_budget_bytes", "the KV budget requests reserve from", registry=r)
        self.kv_reserved = Gauge("specpilot_kv_cache_reserved_bytes", "KV bytes the requests holding rows reserve",
                                 registry=r)
        self.kv_resident = Gauge("specpilot_kv_cache_resident_bytes",
                                 "memory the target's and drafter's KV caches hold now (measured)", registry=r)
        self.queue = Gauge("specpilot_queue_depth", "requests accepted and waiting for a cache row", registry=r)
        self.running = Gauge("specpilot_requests_in_flight", "requests holding a cache row", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
