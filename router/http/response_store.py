"""The Responses API's stored responses (`store: true`, OpenAI's default), in this router's memory.

    store = ResponseStore(max_bytes)        # one per HTTP app (the router's --responses-store-mb)
    store.put(response, items, parent)      # a finished response (completed or incomplete): its object, its
                                            # own conversation items (this request's input items, then its
                                            # output items), and the response it continued (or None)
    store.items(id) -> [item, ...]          # the whole conversation through that response, oldest first
                                            # (previous_response_id); StoreMiss when it or an earlier one
                                            # of its chain is not stored
    store.get(id) -> dict | None            # its response object (GET /v1/responses/{id})
    store.delete(id) -> bool                # DELETE /v1/responses/{id}
    watch(store, metrics_registry)          # /metrics: baton_router_responses_stored, _stored_bytes, _evicted_total

A stored response keeps only its own items and its parent's id, so a long conversation costs its length once,
not once a turn; items() joins the chain. A request with previous_response_id starts from those items, then
its own input (docs/HTTP.md; its `instructions` replace the earlier ones, as OpenAI's do: instructions are not
items). Bounded by `max_bytes` (each response's JSON size: its object and its own items), least recently used
out first. A put or an items() touches the response and then its ancestors, so a parent is always more
recently used than its children: eviction takes the least recently used conversation's latest turn first,
and every stored response's chain stays whole. A response whose chain lost a turn (deleted) can no longer be
continued: StoreMiss names which.
Per router process: routers behind a load balancer each keep their own (a client continuing a conversation
must reach the same router), and a restart forgets them all.
Threads: one lock (the request is parsed in a worker thread, the response stored on the event loop).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class StoreMiss(KeyError):
    """A response (or an earlier turn of its conversation) is not stored: `missing` is its id."""

    def __init__(self, wanted: str, missing: str):
        super().__init__(missing)
        self.wanted, self.missing = wanted, missing


@dataclass
class _Stored:
    response: dict
    items: list  # this request's input items, then its output items (as input items)
    parent: str | None
    size: int


class ResponseStore:
    def __init__(self, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes: {max_bytes}, need > 0")
        self.max_bytes, self.used = max_bytes, 0
        self._lock = threading.Lock()
        self._by_id: OrderedDict[str, _Stored] = OrderedDict()
        self.evicted = 0

    def put(self, response: dict, items: list, parent: str | None) -> bool:
        """Stores a finished response -> False when it alone is larger than the store (then nothing is kept)."""
        size = len(json.dumps(response)) + len(json.dumps(items))
        if size > self.max_bytes:
            return False
        rid = response["id"]
        with self._lock:
            old = self._by_id.pop(rid, None)
            self.used -= old.size if old is not None else 0
            self._by_id[rid] = _Stored(response, items, parent, size)
            self.used += size
            self._touch(rid)
            while self.used > self.max_bytes:
                _, gone = self._by_id.popitem(last=False)
                self.used -= gone.size
                self.evicted += 1
        return True

    def items(self, rid: str) -> list:
        """The conversation through response `rid`, oldest item first; StoreMiss (module doc)."""
        with self._lock:
            chain, at = [], rid
            while at is not None:
                s = self._by_id.get(at)
                if s is None:
                    raise StoreMiss(rid, at)
                chain.append(s)
                at = s.parent
            self._touch(rid)
        return [item for s in reversed(chain) for item in s.items]

    def get(self, rid: str) -> dict | None:
        with self._lock:
            s = self._by_id.get(rid)
            return None if s is None else s.response

    def delete(self, rid: str) -> bool:
        with self._lock:
            s = self._by_id.pop(rid, None)
            if s is None:
                return False
            self.used -= s.size
            return True

    def __len__(self) -> int:
        return len(self._by_id)

    def _touch(self, rid: str) -> None:
        """rid, then each stored ancestor, become the most recently used (the root last: module doc)."""
        at = rid
        while at is not None and at in self._by_id:
            self._by_id.move_to_end(at)
            at = self._by_id[at].parent


class _Collector:
    """The store's figures at each scrape (the store it reads may be replaced: one collector a registry)."""

    def __init__(self, store: ResponseStore):
        self.store = store

    def collect(self):
        st, p = self.store, "baton_router_responses_"
        yield GaugeMetricFamily(p + "stored", "Responses API responses kept (store: true)", value=len(st))
        yield GaugeMetricFamily(p + "stored_bytes", "Their JSON bytes, of --responses-store-mb", value=st.used)
        yield CounterMetricFamily(p + "evicted", "Stored responses evicted for room", value=st.evicted)


_COLLECTORS: dict = {}  # metrics registry -> its _Collector


def watch(store: ResponseStore, registry) -> None:
    """The store's figures join `registry` (read at each scrape)."""
    if registry in _COLLECTORS:
        _COLLECTORS[registry].store = store
    else:
        _COLLECTORS[registry] = _Collector(store)
        registry.register(_COLLECTORS[registry])
