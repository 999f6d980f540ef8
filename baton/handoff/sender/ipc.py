"""Hand-off sender process: its control messages and its shared-memory ring (both sides; no torch, no pickle).

Ring: one anonymous shared-memory file (memfd_create: it never appears under /dev/shm, and the kernel
frees it once the last fd and mapping are gone, so a killed process cannot leak it), cut into `slots`
slots of `slot_bytes`; slot i = bytes [i * slot_bytes, (i + 1) * slot_bytes). The prefill process
writes a chunk's bytes into a slot it owns, then hands the slot to the child (CHUNK); the child frames
the bytes out of it and hands it back (FREE). A slot has one owner at a time: no locks on the memory.

Control channel: a Unix socketpair. Every message starts with HEAD (24 bytes, little-endian):
    kind u8, 3 pad, stream u32, a u32, b u32, n u64
and JSON kinds are followed by n bytes of UTF-8 JSON. Tensor bytes never go through it.
    parent -> child
        OPEN    stream; JSON {target, method, timeout, settings (baton.settings.Settings fields),
                header (base64 of the serialized header StateChunk, sent as is), timeline (bool: stamp
                baton/handoff/timeline.py's sender marks and ask the receiver for its own)}
        CHUNK   stream, a = slot, b = chunk index, n = bytes: chunk b is slot a's bytes [0, n)
        END     stream, n = next_token: every chunk was posted; the trailer can go
        CANCEL  stream: cancel its LoadState call (the decode worker sees CANCELLED)
    child -> parent
        READY   JSON {pid, torch: whether torch got imported (it must not: no CUDA in the child)}
        FREE    a = slot: the child is done with it (framed, or dropped with its stream)
        DONE    stream; JSON {code: grpc.StatusCode name, details, response (base64), chunks, and with
                a timeline: timeline {marks, clocks, series} (baton.handoff.timeline.Timeline.to_json)}
        ADMIT   stream: the decode worker admitted the session (LoadState's initial metadata, before DONE)
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import threading

HEAD = struct.Struct("<B3xIIIQ")
OPEN, CHUNK, END, CANCEL, READY, FREE, DONE, ADMIT = range(1, 9)
_JSON = {OPEN, READY, DONE}
MAX_JSON = 64 << 20  # a header of a huge table stays far below this


class Channel:
    """One end of the control socketpair; send() is thread-safe, recv() is for one reader thread."""

    def __init__(self, sock: socket.socket):
        self.sock, self._lock = sock, threading.Lock()
        self._head = bytearray(HEAD.size)

    def send(
        self, kind: int, stream: int = 0, a: int = 0, b: int = 0, n: int = 0, payload=None, timeout: float | None = None
    ) -> None:
        """timeout: the most seconds to wait for another sender's message to go out first (TimeoutError past
        it: the other side stopped reading); None: no limit."""
        body = b"" if payload is None else json.dumps(payload, separators=(",", ":")).encode()
        msg = HEAD.pack(kind, stream, a, b, len(body) if kind in _JSON else n) + body
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"sender control channel busy for {timeout} s (the other side does not read it)")
        try:
            self.sock.sendall(msg)
        finally:
            self._lock.release()

    def recv(self) -> tuple[int, int, int, int, int, object] | None:
        """-> (kind, stream, a, b, n, JSON payload | None); None at EOF (the other side closed or died)."""
        if not self._read_into(memoryview(self._head)):
            return None
        kind, stream, a, b, n = HEAD.unpack(self._head)
        payload = None
        if kind in _JSON:
            if n > MAX_JSON:
                raise ValueError(f"sender control message of {n} bytes")
            body = bytearray(n)
            if not self._read_into(memoryview(body)):
                return None
            payload = json.loads(body)
        return kind, stream, a, b, n, payload

    def _read_into(self, mv: memoryview) -> bool:
        got = 0
        while got < len(mv):
            k = self.sock.recv_into(mv[got:])  # NOTE: blocks without the GIL
            if k == 0:
                return False
            got += k
        return True

    def close(self) -> None:
        self.sock.close()


class Ring:
    """`slots` x `slot_bytes` of shared memory, mapped in this process (the file itself: .fd)."""

    def __init__(self, fd: int, slots: int, slot_bytes: int):
        self.fd, self.slots, self.slot_bytes = fd, slots, slot_bytes
        self.mm = mmap.mmap(fd, slots * slot_bytes)

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> "Ring":
        fd = os.memfd_create("baton-sender-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, slots * slot_bytes)
            return cls(fd, slots, slot_bytes)
        except BaseException:
            os.close(fd)
            raise

    def view(self, slot: int, n: int) -> memoryview:
        """Bytes [0, n) of `slot` (a view: release it before close())."""
        off = slot * self.slot_bytes
        return memoryview(self.mm)[off : off + n]

    def close(self) -> None:
        """Unmaps and closes the file; raises BufferError while a view of it is alive."""
        self.mm.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
