"""The scale-out endpoint's /metrics: every replica's own series, each sample labelled with its
`replica`, then the ingress's: the replicas that answered (with their process ids) and the router's
decisions (affinity hits, overflow reroutes, least-loaded picks)."""
from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector


def labelled(scrapes: list[tuple[str, str]]) -> list[Metric]:
    """(replica id, its metrics text) for each replica -> one family per name, every sample with its replica."""
    families: dict[str, Metric] = {}
    for replica, text in scrapes:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            merged.samples.extend(s._replace(labels={**s.labels, "replica": replica}) for s in family.samples)
    return list(families.values())


def ingress_metrics(pids: dict[str, int], decisions: dict[str, int]) -> list[Metric]:
    info = GaugeMetricFamily("bie_replica_info", "One series per replica that answered this scrape (value 1), "
                             "with its process id.", labels=["replica", "pid"])
    for replica, pid in sorted(pids.items()):
        info.add_metric([replica, str(pid)], 1)
    routed = CounterMetricFamily("bie_router_decisions", "Requests the router placed, by reason: affinity (the "
                                 "replica that served the prompt's leading blocks), overflow (that replica was "
                                 "overloaded; the least-loaded one took it), least_loaded (no replica held them).",
                                 labels=["reason"])
    for reason, n in decisions.items():
        routed.add_metric([reason], n)
    return [info, GaugeMetricFamily("bie_replicas", "Replicas that answered this scrape.", value=len(pids)), routed]


class _Fixed(Collector):
    def __init__(self, metrics: list[Metric]):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self.metrics


def render(metrics: list[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(metrics))
    return generate_latest(registry)
