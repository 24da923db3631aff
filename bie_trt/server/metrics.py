"""`GET /metrics` through `prometheus_client`, named after vLLM's metrics where one exists
(`vllm:x` -> `bie_x`; the table is in docs/server.md).

Counters and gauges are read from the engine loop (`BieEngine.stats()`) at each scrape by a collector;
the latency histograms are measured here, as clients see them: time to first token from the
request's arrival, the gap between tokens as they reach the response, and the whole request.
Each app has its own registry, so several servers can live in one process (tests).
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from ..executor.outputs import EngineStats
from ..model.cuda_graphs import STEP_KINDS

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_text, value=value)


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


def engine_metrics(stats: EngineStats) -> list[Metric]:
    """One snapshot of the engine's counters and gauges as metric families."""
    finished = CounterMetricFamily("bie_request_success", "Finished requests, by finish reason "
                                   "(error: failed by a fault inside the engine).", labels=["finished_reason"])
    for reason in FINISH_REASONS:
        finished.add_metric([reason], stats.requests.get(reason, 0))
    blocks = GaugeMetricFamily("bie_kv_blocks", "KV blocks by pool and state (used: held by requests; cached: kept "
                               "for prefix hits, evictable; free).", labels=["pool", "state"])
    total = used = 0
    for pool, counts in stats.kv_blocks.items():
        for state, n in counts.items():
            blocks.add_metric([pool, state], n)
        total, used = total + sum(counts.values()), used + counts.get("used", 0)
    queried, hits = stats.prefix_queried_tokens, stats.prefix_hit_tokens
    spec = stats.spec_decode
    by_position = CounterMetricFamily("bie_spec_decode_num_accepted_tokens_per_pos",
                                      "Drafts whose proposal at this position was accepted.", labels=["position"])
    for position, n in enumerate(spec.get("accepted_by_position", [])):
        by_position.add_metric([str(position)], n)
    return [
        finished,
        _counter("bie_prompt_tokens", "Prompt tokens of accepted requests.", stats.prompt_tokens),
        _counter("bie_generation_tokens", "Generated tokens.", stats.generation_tokens),
        _counter("bie_num_preemptions", "Running sequences preempted to free KV blocks.", stats.preemptions),
        _counter("bie_prefix_cache_queries", "Tokens looked up in the prefix cache at admission.", queried),
        _counter("bie_prefix_cache_hits", "Tokens found in the prefix cache.", hits),
        _gauge("bie_prefix_cache_hit_rate", "Hit tokens over queried tokens since start.",
               hits / queried if queried else 0.0),
        _gauge("bie_num_requests_running", "Requests in the running batch.", stats.running),
        _gauge("bie_num_requests_waiting", "Requests waiting to be admitted.", stats.waiting),
        _gauge("bie_kv_cache_usage_perc", "Fraction of KV blocks (all pools) held by requests, 0-1.",
               used / total if total else 0.0),
        blocks,
        _counter("bie_spec_decode_num_drafts", "Speculative drafts proposed.", spec.get("num_drafts", 0)),
        _counter("bie_spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.get("num_draft_tokens", 0)),
        _counter("bie_spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.get("num_accepted_tokens", 0)),
        by_position,
        *adaptive_metrics(spec),
        *host_tier_metrics(stats.host_kv),
        graph_steps(stats.cuda_graphs),
        *disk_tier_metrics(stats.disk_kv),
    ]


def graph_steps(counts: dict) -> Metric:
    """Decode and verify steps replayed from a CUDA graph, and those that fit no captured bucket and ran
    eagerly: correct tokens, lost speed (a verify falling out of its bucket shows here)."""
    steps = CounterMetricFamily("bie_cuda_graph_steps", "Decode and verify steps by how they ran: graph (replayed "
                                "from a captured CUDA graph) or eager (no captured graph held the step; 0 "
                                "without graphs).", labels=["step", "result"])
    for step in STEP_KINDS:
        for result in ("graph", "eager"):
            steps.add_metric([step, result], counts.get(step, {}).get(result, 0))
    return steps


def adaptive_metrics(spec: dict) -> list[Metric]:
    """Adaptive γ: the steps taken at each γ, the probes, and why (the running acceptance by position and the
    step costs the choice weighs); the draft's proposals by where they were drawn."""
    out: list[Metric] = []
    adaptive = spec.get("adaptive")
    if adaptive:
        steps = CounterMetricFamily("bie_spec_decode_gamma_steps", "Decode steps by the proposals they carried "
                                    "(gamma 0: plain decoding).", labels=["gamma"])
        for gamma, n in enumerate(adaptive["steps_by_gamma"]):
            steps.add_metric([str(gamma)], n)
        acceptance = GaugeMetricFamily("bie_spec_decode_acceptance_rate", "Running acceptance of a proposal at this "
                                       "position when all before it were accepted.", labels=["position"])
        for position, rate in enumerate(adaptive["acceptance"]):
            acceptance.add_metric([str(position)], rate)
        costs = adaptive["step_costs"]
        seconds = GaugeMetricFamily("bie_spec_decode_step_seconds", "Running cost per sequence of a step: plain "
                                    "decoding, the verify of rows (gamma + 1), a draft step or a lookup.",
                                    labels=["step", "rows"])
        seconds.add_metric(["plain", "1"], costs["plain_ms"] / 1e3)
        for rows, ms in costs["verify_ms"].items():
            seconds.add_metric(["verify", rows], ms / 1e3)
        for key in ("draft_step_ms", "lookup_ms"):
            if key in costs:
                seconds.add_metric([key[:-3], "0"], costs[key] / 1e3)
        context = GaugeMetricFamily("bie_spec_decode_step_context_tokens", "The context (tokens in the cache a "
                                    "sequence) the step seconds are read at: the latest timed step's.",
                                    value=costs["context"])
        per_context = GaugeMetricFamily("bie_spec_decode_step_cost_per_1k_context", "How much dearer a step is "
                                        "for each 1,000 tokens of context, as a fraction (fitted over the steps "
                                        "timed; verify costs are compared with a plain step at the same context).",
                                        value=costs["cost_per_1k_context"])
        out += [steps, _counter("bie_spec_decode_gamma_probes", "Probes: one proposal from a request decoding "
                                "plainly, to see whether speculation pays again.", adaptive["probes"]),
                acceptance, seconds, context, per_context]
    drawn = spec.get("draft_proposals")
    if drawn:
        where = CounterMetricFamily("bie_spec_decode_draft_proposals", "Draft proposals by where they were drawn "
                                    "(host: a grammar, penalties, logit_bias or min_tokens).", labels=["drawn"])
        for place, n in drawn.items():
            where.add_metric([place], n)
        out.append(where)
    return out


def host_tier_metrics(host: dict) -> list[Metric]:
    """The KV cache's host tier: its use and bound, the prompt tokens it served, and its copies each way."""
    copied = CounterMetricFamily("bie_host_kv_copied_bytes", "Bytes copied between the device KV pools and the "
                                 "host tier (offload: evicted blocks down; restore: hits back up).",
                                 labels=["direction"])
    seconds = CounterMetricFamily("bie_host_kv_copy_seconds", "Time spent launching those copies (the copies "
                                  "themselves on the CPU).", labels=["direction"])
    for direction, key in (("offload", "offloaded"), ("restore", "restored")):
        copied.add_metric([direction], host.get(f"{key}_bytes", 0))
        seconds.add_metric([direction], host.get(f"{direction}_seconds", 0.0))
    return [
        _gauge("bie_host_kv_cache_capacity_bytes", "Bound of the KV cache's host tier (0: off).",
               host.get("capacity_bytes", 0)),
        _gauge("bie_host_kv_cache_used_bytes", "Bytes of KV blocks the host tier holds.", host.get("used_bytes", 0)),
        _gauge("bie_host_kv_cache_blocks", "KV blocks the host tier holds.", host.get("blocks", 0)),
        _counter("bie_host_kv_cache_hits", "Prompt tokens served by copying blocks back from the host tier.",
                 host.get("hit_tokens", 0)),
        copied,
        seconds,
    ]


def disk_tier_metrics(disk: dict) -> list[Metric]:
    """The KV cache's disk tier: its bound and use, the prompt tokens it served and missed, its reads, writes,
    evictions and refused files."""
    copied = CounterMetricFamily("bie_disk_kv_bytes", "Bytes of KV block files read back (hits) and written.",
                                 labels=["direction"])
    copied.add_metric(["read"], disk.get("read_bytes", 0))
    copied.add_metric(["written"], disk.get("written_bytes", 0))
    return [
        _gauge("bie_disk_kv_cache_capacity_bytes", "Bound of the KV cache's disk tier, over every engine's files "
               "in its directory (0: off).", disk.get("capacity_bytes", 0)),
        _gauge("bie_disk_kv_cache_used_bytes", "Bytes of KV block files in the disk tier's directory.",
               disk.get("used_bytes", 0)),
        _counter("bie_disk_kv_cache_hits", "Prompt tokens read back from the disk tier (missed on the device and "
                 "in host memory).", disk.get("hit_tokens", 0)),
        _counter("bie_disk_kv_cache_misses", "Prompt tokens of full blocks no tier held (computed).",
                 disk.get("missed_tokens", 0)),
        copied,
        _counter("bie_disk_kv_cache_evictions", "Block files deleted to keep the disk tier within its bound.",
                 disk.get("evictions", 0)),
        _counter("bie_disk_kv_cache_bad_files", "Block files refused (torn, damaged, another engine's) and "
                 "deleted.", disk.get("bad_files", 0)),
    ]


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        yield from engine_metrics(self._stats())


class Metrics:
    """The registry one server exposes: the engine's numbers plus the latency histograms."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(stats))
        self.ttft = Histogram("bie_time_to_first_token_seconds", "Time from a request's arrival to its first token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("bie_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("bie_e2e_request_latency_seconds", "Time from a request's arrival to its last token.",
                             buckets=E2E_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
