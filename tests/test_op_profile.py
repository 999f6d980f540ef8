"""baton/op_profile.py: the torch.profiler window over a worker's exact-round batches (BATON_OP_PROFILE)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from baton import op_profile


def test_parse_window():
    assert op_profile.parse_window(None) == op_profile.DEFAULT_WINDOW
    assert op_profile.parse_window("") == op_profile.DEFAULT_WINDOW
    assert op_profile.parse_window("5:3") == (5, 3, 1)
    assert op_profile.parse_window("0:1:4") == (0, 1, 4)
    for bad in ("5", "1:0", "-1:2", "1:2:3:4", "a:b"):
        with pytest.raises(ValueError):
            op_profile.parse_window(bad)


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv(op_profile.ENV, raising=False)

    def fn(items):
        return items

    assert op_profile.window(fn, "decode") is fn


def _batch(items):
    """A batch function whose ops tell the window's batches from the others: items [v, ...]; v < 0 runs a
    cumsum (a batch that must fall outside the window), else a matmul."""
    x = torch.ones(8, 8)
    y = torch.cumsum(x, 0) if items[0] < 0 else torch.mm(x, x)
    if items[0] == 7:
        raise RuntimeError("a failing batch")
    return [float(y[0, 0])] * len(items)


def test_window_profiles_batches_after_the_skipped_ones(tmp_path, monkeypatch):
    monkeypatch.setenv(op_profile.ENV, str(tmp_path / "ops-{role}-{pid}.txt"))
    monkeypatch.setenv(op_profile.WINDOW_ENV, "2:3:2")
    w = op_profile.window(_batch, "prefill")
    assert isinstance(w, op_profile.Window)
    # a 1-item batch is not counted (M = 2); two of >= 2 items are skipped; then 3 batches of any size
    assert w([-1]) == [1.0]
    assert w([-1, -1]) == [1.0, 1.0] and w([-1, -1, -1]) == [1.0] * 3
    assert w.prof is None
    # the window's batches run on different threads (a Gather's callers take turns leading): the profiler
    # still stops (torch's must stop on the thread that started it: the window's own thread does both)
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(w, [1]).result() == [8.0]
    with pytest.raises(RuntimeError):  # a batch that raises still counts, and its error reaches its callers
        w([7, 7])
    assert w([1, 1, 1]) == [8.0] * 3
    assert w.done.wait(30)
    assert w([-1, -1]) == [1.0, 1.0]  # after the window: run as is
    path = tmp_path / f"ops-prefill-{os.getpid()}.txt"
    text = path.read_text()
    assert "3 batches (6 items) after 2 of >= 2 items" in text
    assert "# by self CPU time" in text and "aten::mm" in text
    assert "aten::cumsum" not in text  # the skipped batches' ops are not in it
    assert w.profiled == 3 and w.items == 6 and w.in_batches > 0


def test_finish_closes_an_open_window_and_waits_for_its_report(tmp_path, monkeypatch):
    """A worker's clean stop (op_profile.finish): a window that did not fill is closed with the batches it
    had, and its report is written before finish returns (the process would otherwise exit under it)."""
    monkeypatch.setenv(op_profile.ENV, str(tmp_path / "ops-{role}.txt"))
    monkeypatch.setenv(op_profile.WINDOW_ENV, "0:100")
    monkeypatch.setattr(op_profile, "_WINDOWS", [])
    w = op_profile.window(_batch, "decode")
    idle = op_profile.window(_batch, "prefill")  # never called: no report
    for _ in range(3):
        assert w([1, 1]) == [8.0, 8.0]
    assert not w.done.is_set()
    written = op_profile.finish(timeout_s=30)
    assert written == [str(tmp_path / "ops-decode.txt")] and not idle.done.is_set()
    assert "3 batches (6 items)" in (tmp_path / "ops-decode.txt").read_text()
