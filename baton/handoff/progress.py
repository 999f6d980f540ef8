"""PrefillProgress: which parts of one prefill's state are final, for a sender on another thread.

Stages (in the order prefill finishes them, which is the wire's table order):
    0 .. N-1   decoder layer i: its GDN conv/recurrent state or its attention KV rows are written
    N          the tail: final hidden row, MTP KV, next_token (known once the logits are)
Lifecycle:
    compute thread   mark(i) from the model's layer hook (StepContext.state_written) right after the
                     kernels that write layer i's state were *enqueued* (its KV rows, or its GDN conv
                     and recurrent state: mid-layer, before o_proj / out_proj and the MLP, which write
                     no state; so the last layer's state streams while the layer finishes). On CUDA it
                     records an event on the current stream, never a host sync; on CPU those kernels
                     have simply run (last_layer_ns: when the last layer was marked, for the hand-off's
                     timeline). finish(next_token) after the prefill
                     returned (finished_ns: when); fail(exc) if it raised.
    sender thread    wait(stage) blocks until that stage was marked (raises the compute's error if it
                     failed) and returns its CUDA event (None on CPU); the D2H copy waits for the event
                     on its own stream, so the wire runs beside the remaining layers' compute.
"""

from __future__ import annotations

import re
import threading
import time

import torch

_LAYER = re.compile(r"layers\.(\d+)\.")


class PrefillFailed(RuntimeError):
    """The prefill this stream was waiting for raised (the sender's stream is then cancelled)."""


def stage_of(name: str, layers: int) -> int:
    """Stage after which the state tensor `name` (baton.engine.state export names) is final."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else layers


def tail_offset(specs, tail_layers: int) -> int:
    """Byte offset in the table (rows with .name and .nbytes, table order) where the tensors of the last
    `tail_layers` decoder layers start, with everything after them (hidden, MTP KV: the final stage):
    what is left to send once the prefill ends. tail_layers 0: the final stage only. Layers are numbered
    by the names (`layers.{i}.`), so the table's last layer index + 1 is the layer count."""
    if tail_layers < 0:
        raise ValueError(f"tail_layers must be >= 0, got {tail_layers}")
    layers = 1 + max((int(m.group(1)) for s in specs if (m := _LAYER.match(s.name))), default=-1)
    off = sum(s.nbytes for s in specs)
    for s in reversed(specs):  # NOTE: layer-major table: the tail is a suffix
        if stage_of(s.name, layers) < layers - tail_layers:
            break
        off -= s.nbytes
    return off


class PrefillProgress:
    def __init__(self, layers: int, device: torch.device):
        self.layers, self._device = layers, torch.device(device)
        self._cuda = self._device.type == "cuda"
        self._events: list = [None] * (layers + 1)
        self._marked = 0  # stages 0 .. _marked-1 are final
        self._token: int | None = None
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self.last_layer_ns = 0  # time.monotonic_ns() when stage layers-1 was marked
        self.finished_ns = 0  # ... when finish() was called (before the last stage is marked)

    def mark(self, stage: int) -> None:
        """Compute thread: stage `stage` is final once the work enqueued so far has run."""
        ev = None
        if self._cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self._device))
        if stage == self.layers - 1:
            self.last_layer_ns = time.monotonic_ns()
        with self._cv:
            if stage != self._marked:
                raise RuntimeError(f"progress: stage {stage} marked after {self._marked - 1}")
            self._events[stage], self._marked = ev, stage + 1
            self._cv.notify_all()

    def finish(self, next_token: int) -> None:
        """Compute thread: the prefill returned; the tail (hidden row, MTP KV, next_token) is final."""
        self.finished_ns = time.monotonic_ns()
        self._token = int(next_token)
        self.mark(self.layers)

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            self._error = exc
            self._cv.notify_all()

    def wait(self, stage: int):
        """Sender thread: blocks until `stage` is marked; -> its CUDA event (None on CPU)."""
        with self._cv:
            while self._marked <= stage and self._error is None:
                self._cv.wait()
            if self._marked <= stage:
                raise PrefillFailed(f"prefill failed before stage {stage}: {self._error!r}")
            return self._events[stage]

    def next_token(self) -> int:
        """The prefill's first token (the trailer asks for it after every tensor, i.e. after finish)."""
        self.wait(self.layers)
        return self._token

    def source(self, tensors):
        """(tensor, ready event) for each baton.engine.state.StateTensor, each once its stage is final:
        a wire tensor_source. A lazy tensor (paged KV: StateTensor.gather) on CUDA is, with staging.kv_in_place
        (the stager copies by address), its pages read in place (StateTensor.paged: a PagedSource, gated on
        the stage's event); else gathered then, on the copy stream after the stage's
        event (never a host sync), its own event recorded after it. On CPU: gathered."""
        from baton.handoff import staging

        in_place = self._cuda and staging.kv_in_place()
        for t in tensors:
            ev = self.wait(stage_of(t.name, self.layers))
            if getattr(t, "gather", None) is None:
                yield t.tensor, ev
            elif not self._cuda:
                yield t.gather(), None
            elif in_place and getattr(t, "paged", None) is not None:
                yield t.paged(), ev
            else:
                stream = staging.copy_stream(self._device)
                with torch.cuda.stream(stream):
                    if ev is not None:
                        stream.wait_event(ev)
                    out = t.gather()
                    done = torch.cuda.Event()
                    done.record(stream)
                yield out, done
