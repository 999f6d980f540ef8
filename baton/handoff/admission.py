"""The receiver's admission of a hand-off: LoadState answers its initial metadata with ADMITTED once it has
reserved the session's slot (decode_worker/service.py), long before its answer at the end of the stream.
From then on it can no longer refuse the session for full slots, so the prefill worker may send the first
token before the state has landed (PrefillStream; docs/CONTRACTS.md, "Early first token"). No torch here:
the sender child process (baton/handoff/sender/child.py) uses it too."""

from __future__ import annotations

import threading
from typing import Callable

ADMITTED = ("baton-admitted", "1")  # LoadState's initial metadata once the receiver reserved the session's slot


def admitted_by(metadata) -> bool:
    """Whether a LoadState call's initial metadata says the receiver admitted the session."""
    return any(tuple(kv) == ADMITTED for kv in metadata or ())


def wait_admitted(admitted: threading.Event, ended: Callable[[], bool], is_active: Callable[[], bool] | None) -> bool:
    """Push.admitted / ProcessPush.admitted: waits until `admitted` is set -> True, or until the call ended
    (ended()) or the calling RPC did (is_active() False) first -> whether it was set by then."""
    while not admitted.wait(0.02):
        if ended() or (is_active is not None and not is_active()):
            return admitted.is_set()
    return True


def watch_admission(call, on_admitted) -> None:
    """Calls on_admitted() once `call` (a LoadState future) got its initial metadata with ADMITTED; a daemon
    thread waits for it (initial_metadata() returns at the headers or at the call's end)."""

    def wait():
        try:
            if admitted_by(call.initial_metadata()):
                on_admitted()
        except Exception:  # noqa: BLE001 - a call that broke is answered by its result
            pass

    threading.Thread(target=wait, daemon=True, name="baton-handoff-admission").start()
