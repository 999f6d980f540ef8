"""ChannelPool: a bounded LRU cache of gRPC channels, one per (target address, Settings).

A prefill worker dials every `decode_target` it is given. Under Ray restarts decode workers come back on
new ports, so an unbounded cache would grow for as long as the worker lives (issue 24). This one keeps
at most `max_channels` (default DEFAULT_MAX_CHANNELS) and closes the least recently used beyond that.

    with pool.lease(address, settings) as channel:     # counted in use until the block ends
        stub = decode_pb2_grpc.DecodeWorkerStub(channel); stub.Release(...)
    lease = pool.lease(address, settings)              # a call that outlives the block (a push):
    fut = channel_method.future(...); fut.add_done_callback(lambda _: lease.release())

A channel is never closed under a call that holds a lease: eviction picks the least recently used
channel nobody leases; when every cached channel is leased it still drops the oldest from the cache (the
bound holds), and that channel is closed when its last lease is released. `get()` (the interface before
leases) returns a cached channel without a lease: such a channel may be closed by a later eviction, so
calls should lease. close() closes every channel, leased or not (shutdown).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

import grpc

from baton.rpc import make_channel
from baton.settings import Settings

DEFAULT_MAX_CHANNELS = 64  # distinct decode workers one prefill worker talks to; far above any deployment's
Key = tuple[str, Settings]


class _Entry:
    __slots__ = ("channel", "leases", "cached")

    def __init__(self, channel: grpc.Channel):
        self.channel, self.leases, self.cached = channel, 0, True


class Lease:
    """One use of a pooled channel; release() (idempotent) or leave the `with` block to end it."""

    def __init__(self, pool: "ChannelPool", entry: _Entry):
        self._pool, self._entry, self._released = pool, entry, False
        self.channel = entry.channel

    def release(self) -> None:
        self._pool._release(self)

    def __enter__(self) -> grpc.Channel:
        return self.channel

    def __exit__(self, *exc) -> None:
        self.release()


class ChannelPool:
    """At most `max_channels` cached channels made by `factory` (baton.rpc.make_channel); LRU eviction,
    idle channels closed at once, leased ones when their last lease is released."""

    def __init__(
        self, max_channels: int = DEFAULT_MAX_CHANNELS, factory: Callable[[str, Settings], grpc.Channel] | None = None
    ):
        if max_channels < 1:
            raise ValueError(f"max_channels: must be >= 1, got {max_channels}")
        self.max_channels, self._factory = max_channels, factory or make_channel
        self._lock = threading.Lock()
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()  # least recently used first
        self._retired: set[_Entry] = set()  # evicted while leased: open until released

    def __bool__(self) -> bool:  # NOTE: an empty pool is still a pool (`pool or DEFAULT_POOL`), whatever len()
        return True

    def __len__(self) -> int:
        """Channels in the cache (<= max_channels)."""
        with self._lock:
            return len(self._entries)

    def open_channels(self) -> int:
        """Channels not yet closed: the cache plus evicted ones still leased."""
        with self._lock:
            return len(self._entries) + len(self._retired)

    def _entry(self, address: str, settings: Settings) -> tuple[_Entry, list[grpc.Channel]]:
        """The entry for the key, most recently used now; -> (entry, channels to close). Under the lock."""
        key = (address, settings)
        e = self._entries.get(key)
        if e is not None:
            self._entries.move_to_end(key)
            return e, []
        e = self._entries[key] = _Entry(self._factory(address, settings))
        close: list[grpc.Channel] = []
        while len(self._entries) > self.max_channels:
            victim = next((k for k, v in self._entries.items() if v.leases == 0 and v is not e), None)
            if victim is None:  # every other channel is in use: drop the oldest, close it on its last release
                victim = next(iter(self._entries))
            old = self._entries.pop(victim)
            old.cached = False
            if old.leases:
                self._retired.add(old)
            else:
                close.append(old.channel)
        return e, close

    def lease(self, address: str, settings: Settings) -> Lease:
        with self._lock:
            e, close = self._entry(address, settings)
            e.leases += 1
        _close(close)
        return Lease(self, e)

    def get(self, address: str, settings: Settings) -> grpc.Channel:
        """The cached channel, without a lease (see the module doc): prefer lease() for calls."""
        with self._lock:
            e, close = self._entry(address, settings)
        _close(close)
        return e.channel

    def _release(self, lease: Lease) -> None:
        with self._lock:
            if lease._released:
                return
            lease._released = True
            e = lease._entry
            e.leases -= 1
            last = e.leases == 0 and not e.cached and e in self._retired
            if last:
                self._retired.discard(e)
        if last:
            e.channel.close()

    def close(self) -> None:
        """Close every channel (shutdown); the pool may be used again afterwards."""
        with self._lock:
            chans = [e.channel for e in self._entries.values()] + [e.channel for e in self._retired]
            for e in self._entries.values():
                e.cached = False
            self._entries, self._retired = OrderedDict(), set()
        _close(chans)


def _close(channels: list[grpc.Channel]) -> None:
    for ch in channels:  # NOTE: outside the lock: close() cancels the channel's calls (idle ones: none)
        ch.close()
