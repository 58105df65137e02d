"""Prometheus metrics of one server (its own registry: two servers in one process never mix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from opus.serve.scheduler import Engine

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                   5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("opus_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("opus_requests_waiting", "Requests waiting for a batch row or KV blocks", registry=r)
        self.kv_used = Gauge("opus_kv_blocks_used", "KV blocks held by requests or the prefix cache", registry=r)
        self.kv_total = Gauge("opus_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.kv_total.set(engine.blocks.usable)
        self.ttft = Histogram("opus_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("opus_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("opus_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("opus_generation_tokens", "Tokens generated", registry=r)
        self.prefix_hits = Counter("opus_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                   registry=r)
        self.requests = Counter("opus_requests", "Requests answered, by HTTP status", ["status"], registry=r)
        self._seen = {"prompt": 0, "generation": 0, "hits": 0}
        engine.observe = self.observe

    def observe(self, name: str, seconds: float) -> None:
        (self.ttft if name == "ttft" else self.itl).observe(seconds)

    def render(self) -> bytes:
        """The exposition text, the gauges and counters read from the engine now."""
        e = self.engine
        self.running.set(len(e.running))
        self.waiting.set(len(e.waiting))
        self.kv_used.set(e.blocks.used)
        for key, counter, value in (("prompt", self.prompt_tokens, e.stats.prompt_tokens),
                                    ("generation", self.generation_tokens, e.stats.generation_tokens),
                                    ("hits", self.prefix_hits, e.blocks.hits)):
            counter.inc(value - self._seen[key])
            self._seen[key] = value
        return generate_latest(self.registry)
