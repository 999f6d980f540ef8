"""Fault-injection helpers for tests/system/test_reliability_faults.py: a TCP proxy that cuts or corrupts a
stream at a byte offset, and a polling wait."""

from __future__ import annotations

import socket
import threading
import time


def until(cond, timeout: float, what: str, step: float = 0.005):
    """Polls cond() every `step` s until it is truthy; returns it (AssertionError after `timeout`)."""
    end = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(step)
    return got


class CutProxy:
    """TCP proxy to `target`. Armed with cut_at=N it forwards N more client->server bytes, then resets both
    sides (a sender that died mid-message); armed with flip_at=N it XORs that byte (corruption on the wire)."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.srv.getsockname()[1]}"
        self.lock = threading.Lock()
        self.count, self.cut_at, self.flip_at = 0, None, None
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, cut_at=None, flip_at=None):
        with self.lock:
            self.count, self.cut_at, self.flip_at = 0, cut_at, flip_at

    def _accept(self):
        while True:
            try:
                a, _ = self.srv.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(a, b, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a, False), daemon=True).start()

    def _pump(self, src, dst, upstream):
        try:
            while data := src.recv(65536):
                if upstream:
                    with self.lock:
                        base, self.count = self.count, self.count + len(data)
                        cut, flip = self.cut_at, self.flip_at
                    if flip is not None and base <= flip < base + len(data):
                        data = bytearray(data)
                        data[flip - base] ^= 0x10
                        data = bytes(data)
                    if cut is not None and base + len(data) >= cut:
                        dst.sendall(data[: max(0, cut - base)])
                        for s in (src, dst):  # RST both ways: the peer sees a dead connection
                            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                            s.close()
                        return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self):
        self.srv.close()
