"""The request routers of the replica deployment, on Ray Serve's request-router extension point.

Ray Serve runs a router inside each process holding a handle to the deployment (here: the ingress, in
the `bie-trt serve` process) and asks `choose_replicas` for ranked candidates; it then sends the
request to the first candidate of a rank whose queue has room. The scoring is affinity.py's; this
module only feeds it the live replicas and the requests each has in flight from this router, and keeps
the decision counters /metrics shows. Both routers also honour a hint naming one replica, so the
ingress can scrape every replica's metrics through the same handle.
"""
from __future__ import annotations

import collections
from typing import Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

from . import live
from .affinity import AFFINITY, LEAST_LOADED, OVERFLOW, AffinityTable, RouteHint, choose, prefix_keys

REASONS = (AFFINITY, OVERFLOW, LEAST_LOADED)


def router_of(deployment: str) -> Optional["_Targeted"]:
    """This process's router for `deployment`: made by Ray Serve at the handle's first request."""
    return live.ROUTERS.get(deployment)


def _hint(pending_request: Optional[PendingRequest]) -> RouteHint | None:
    return None if pending_request is None else pending_request.kwargs.get("route")


class _Targeted(RequestRouter):
    """A hint naming a replica goes to that replica alone; everything else to `score`."""

    def initialize_state(self, **kwargs) -> None:
        live.ROUTERS[self._deployment_id.name] = self

    def replica_ids(self) -> list[str]:
        return sorted(replica.unique_id for replica in list(self._replicas))

    def counts(self) -> dict[str, int]:
        return {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        hint = _hint(pending_request)
        if hint is not None and hint.replica is not None:
            # a replica that is gone yields no candidate: the router backs off until the caller gives up
            return [[r for r in candidate_replicas if r.replica_id.unique_id == hint.replica]]
        return await self.score(candidate_replicas, pending_request, hint)

    async def score(self, candidate_replicas: list[RunningReplica], pending_request: Optional[PendingRequest],
                    hint: RouteHint | None) -> list[list[RunningReplica]]:
        raise NotImplementedError


class PrefixAffinityRouter(_Targeted):
    """Prompts to the replica that served their leading blocks lately, unless it has more than `overload`
    requests beyond the least-loaded replica; else, and for new prompts, to the least-loaded one."""

    def initialize_state(self, block_size: int = 16, overload: int = 4, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self.block_size, self.overload = block_size, overload
        self.table = AffinityTable()
        self.decided: dict[str, tuple[str, str]] = {}   # internal request id -> (replica, reason), in flight
        self.decisions: collections.Counter[str] = collections.Counter()

    def counts(self) -> dict[str, int]:
        return {reason: self.decisions[reason] for reason in REASONS}

    async def score(self, candidate_replicas: list[RunningReplica], pending_request: Optional[PendingRequest],
                    hint: RouteHint | None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = dict.fromkeys(by_id, 0)
        request_id = pending_request.metadata.internal_request_id
        for other, (replica, _) in self.decided.items():
            if replica in loads and other != request_id:
                loads[replica] += 1
        ids = hint.prefix_ids if hint is not None else None
        keys = prefix_keys(ids or (), self.block_size)
        choice = choose(keys, loads, self.table, self.overload)
        # counted: requests with a prompt, once each (a retry after a full queue is not a second decision)
        if ids is not None and request_id not in self.decided:
            self.decisions[choice.reason] += 1
        self.decided[request_id] = (choice.replica, choice.reason)
        self.table.record(keys, choice.replica)
        return [[by_id[choice.replica]]]

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.decided.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        # its cache died with it: prompts it held go where the load is least from now on
        dead = replica_id.unique_id
        self.decided = {rid: d for rid, d in self.decided.items() if d[0] != dead}


class PowerOfTwoRouter(_Targeted, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default routing (two random replicas, the shorter queue of the two), for comparison."""

    async def score(self, candidate_replicas: list[RunningReplica], pending_request: Optional[PendingRequest],
                    hint: RouteHint | None) -> list[list[RunningReplica]]:
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)


ROUTERS = {"prefix-affinity": PrefixAffinityRouter, "power-of-two": PowerOfTwoRouter}
