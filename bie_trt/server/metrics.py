"""`GET /metrics` in the Prometheus text format (version 0.0.4), written out by hand.

Counters and gauges come from the engine loop (`BieEngine.stats()`); the latency histograms are
measured here, as clients see them: time to first token from the request's arrival, and the gap
between tokens as they are handed to the response.
"""
from __future__ import annotations

import bisect

from ..executor.engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
FINISH_REASONS = ("stop", "length", "abort")


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _sample(name: str, value: float, **labels: str) -> str:
    where = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{where}}} {value}" if where else f"{name} {value}"


class Histogram:
    """Observed by the server's event loop thread only, so it needs no lock."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help_text, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)   # per bucket (not cumulative); the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self) -> list[str]:
        out, running = _header(self.name, "histogram", self.help_text), 0
        for le, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            running += count
            out.append(_sample(f"{self.name}_bucket", running, le=le))
        return out + [_sample(f"{self.name}_sum", self.total), _sample(f"{self.name}_count", running)]


class Metrics:
    def __init__(self) -> None:
        self.ttft = Histogram("bie_time_to_first_token_seconds", "Time from a request's arrival to its first token.",
                              TTFT_BUCKETS)
        self.itl = Histogram("bie_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             ITL_BUCKETS)

    def render(self, stats: EngineStats) -> str:
        lines = _header("bie_requests_total", "counter", "Finished requests, by finish reason.")
        lines += [_sample("bie_requests_total", stats.requests.get(r, 0), finish_reason=r) for r in FINISH_REASONS]
        for name, value, help_text in [
            ("bie_prompt_tokens_total", stats.prompt_tokens, "Prompt tokens of accepted requests."),
            ("bie_generation_tokens_total", stats.generation_tokens, "Generated tokens."),
            ("bie_preemptions_total", stats.preemptions, "Running sequences preempted to free KV blocks."),
            ("bie_prefix_cache_queries_total", stats.prefix_queried_tokens,
             "Tokens looked up in the prefix cache at admission."),
            ("bie_prefix_cache_hits_total", stats.prefix_hit_tokens, "Tokens found in the prefix cache."),
        ]:
            lines += _header(name, "counter", help_text) + [_sample(name, value)]
        rate = stats.prefix_hit_tokens / stats.prefix_queried_tokens if stats.prefix_queried_tokens else 0.0
        lines += _header("bie_prefix_cache_hit_rate", "gauge", "Hit tokens over queried tokens since start.")
        lines.append(_sample("bie_prefix_cache_hit_rate", rate))
        lines += _header("bie_kv_blocks", "gauge", "KV blocks by pool and state (used: held by requests; cached: "
                                                   "kept for prefix hits, evictable; free).")
        lines += [_sample("bie_kv_blocks", n, pool=pool, state=state)
                  for pool, counts in stats.kv_blocks.items() for state, n in counts.items()]
        lines += _header("bie_num_requests", "gauge", "Requests in the engine, by state.")
        lines += [_sample("bie_num_requests", stats.running, state="running"),
                  _sample("bie_num_requests", stats.waiting, state="waiting")]
        lines += self.ttft.lines() + self.itl.lines()
        return "\n".join(lines) + "\n"
