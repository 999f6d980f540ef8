"""State wire format, framing: serialized header / data / trailer StateChunks and the manifest digest.

No torch here (numpy, hashlib, protobuf only), so the hand-off sender process (baton/handoff/sender/child.py)
frames chunks with exactly the code the in-process sender uses (baton/handoff/encode.py) without importing
torch: the two senders put byte-identical frames on the wire for the same state.

    header_frame(header)                    StateChunk(header) serialized
    frame(index, pieces) -> (bytes, digest) the data StateChunk of one chunk, framed by hand (fields in
                                            number order, as protobuf serializes them): one copy out of
                                            `pieces` (buffers), chunk_sha256 = SHA-256 of the payload
    Manifest(header).add(digest) ...        the trailer's manifest_sha256, built as chunks go out
    trailer_frame(manifest, total, token)   StateChunk(trailer) serialized, manifest digest filled in
GIL: frame() makes large frames (>= 256 KiB) with no pass over the bytes under the GIL: an uninitialized
bytes object (C API) filled by numpy copies, hashed by one hashlib call (both release the GIL).
"""

from __future__ import annotations

import ctypes
import hashlib
import io

import numpy as np

from baton.v1 import state_pb2

DIGEST_BYTES = 32  # SHA-256
MANIFEST_TAG = b"baton/state/v3\n"
_DATA_TAG = b"\x12"  # StateChunk field 2 (data), wire type 2 (length-delimited)
_INDEX_TAG = b"\x20"  # field 4 (chunk_index), varint; omitted when 0, as protobuf does
_SHA_TAG = b"\x2a\x20"  # field 5 (chunk_sha256), length 32
_COPY_OUTSIDE_GIL_BYTES = 256 << 10  # smaller frames are joined (under the GIL, but briefly)
FRAME_OVERHEAD = 64  # bytes of a data frame beyond its payload, at most (tag + length, index, digest: <= 57)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class Manifest:
    """The trailer's manifest_sha256, built incrementally from the header and the chunk digests in order."""

    def __init__(self, header: state_pb2.StateHeader):
        self._h = hashlib.sha256(MANIFEST_TAG)
        self._h.update(hashlib.sha256(header.SerializeToString(deterministic=True)).digest())
        self.chunks = 0

    def add(self, chunk_digest: bytes) -> None:
        self._h.update(chunk_digest)
        self.chunks += 1

    def digest(self, trailer: state_pb2.StateTrailer) -> bytes:
        """Over everything so far and the trailer's fields (its manifest_sha256 left out)."""
        t = state_pb2.StateTrailer()
        t.CopyFrom(trailer)
        t.ClearField("manifest_sha256")
        h = self._h.copy()
        h.update(hashlib.sha256(t.SerializeToString(deterministic=True)).digest())
        return h.digest()


def header_frame(header: state_pb2.StateHeader) -> bytes:
    return state_pb2.StateChunk(header=header).SerializeToString()


def trailer_frame(manifest: Manifest, total_bytes: int, next_token: int) -> bytes:
    """The last message: total_bytes, data_chunks (as counted by `manifest`), next_token, manifest_sha256."""
    trailer = state_pb2.StateTrailer(total_bytes=total_bytes, data_chunks=manifest.chunks, next_token=next_token)
    trailer.manifest_sha256 = manifest.digest(trailer)
    return state_pb2.StateChunk(trailer=trailer).SerializeToString()


def _sha256(pieces: list) -> bytes:
    h = hashlib.sha256()
    for p in pieces:
        h.update(p)  # NOTE: releases the GIL for pieces >= 2 KiB
    return h.digest()


def frame(index: int, pieces: list) -> tuple[bytes, bytes]:
    """(serialized data StateChunk, chunk_sha256) of chunk `index` whose payload is `pieces` concatenated
    (buffers of uint8: memoryviews of tensor, staging or shared memory; read, never kept)."""
    n = sum(map(len, pieces))
    head = _DATA_TAG + _varint(n)

    def tail(d: bytes) -> bytes:
        return (_INDEX_TAG + _varint(index) if index else b"") + _SHA_TAG + d

    if n < _COPY_OUTSIDE_GIL_BYTES:
        d = _sha256(pieces)
        return b"".join([head, *pieces, tail(d)]), d
    # NOTE: b"".join holds the GIL while copying memoryviews; instead the frame's bytes object is made
    # first and filled by numpy copies (no GIL) through a writable view that dies before it is handed on.
    # The digest is taken over the payload as copied into the frame, in one call: a chunk of k pieces
    # takes the GIL back k + 1 times (copies, hash), not 2k (each such re-acquisition waits up to the
    # switch interval while a prefill thread runs Python).
    size = len(head) + n + len(tail(b"\0" * DIGEST_BYTES))
    out, mv = _new_bytes(size) if _new_bytes is not None else _zeroed_bytesio(size)
    with mv:
        dst, off = np.frombuffer(mv, dtype=np.uint8), len(head)
        dst[:off] = np.frombuffer(head, dtype=np.uint8)
        for p in pieces:
            np.copyto(dst[off : off + len(p)], np.frombuffer(p, dtype=np.uint8))
            off += len(p)
        d = hashlib.sha256(mv[len(head) : off]).digest()  # NOTE: releases the GIL (>= 2 KiB)
        dst[off:] = np.frombuffer(tail(d), dtype=np.uint8)
        del dst  # NOTE: before the view is released
    return (out.getvalue() if isinstance(out, io.BytesIO) else out), d


def _zeroed_bytesio(size: int) -> tuple[io.BytesIO, memoryview]:
    """(a BytesIO of `size` zero bytes, its buffer): one zero-filling pass under the GIL; once the buffer
    is released, getvalue() hands out the bytes object itself (CPython: no copy)."""
    buf = io.BytesIO()
    buf.seek(size - 1)
    buf.write(b"\0")
    return buf, buf.getbuffer()


def _new_bytes_capi(size: int) -> tuple[bytes, memoryview]:
    """(a new bytes object of `size` uninitialized bytes, a writable memoryview of them): the C API's
    PyBytes_FromStringAndSize(NULL, size), so no pass over the bytes under the GIL (the kernel's fresh
    pages are touched first by the fill). Filled before anyone else sees it (refcount 1, no hash yet)."""
    b = _PyBytes_FromStringAndSize(None, size)
    return b, memoryview((ctypes.c_char * size).from_address(_PyBytes_AsString(b))).cast("B")


try:  # CPython's C API through ctypes.pythonapi (those calls keep the GIL, as C API calls must)
    _PyBytes_FromStringAndSize = ctypes.pythonapi.PyBytes_FromStringAndSize
    _PyBytes_FromStringAndSize.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
    _PyBytes_FromStringAndSize.restype = ctypes.py_object
    _PyBytes_AsString = ctypes.pythonapi.PyBytes_AsString
    _PyBytes_AsString.argtypes, _PyBytes_AsString.restype = [ctypes.py_object], ctypes.c_void_p
    _new_bytes = _new_bytes_capi
except (AttributeError, OSError):  # another Python: the zero-filled BytesIO
    _new_bytes = None
