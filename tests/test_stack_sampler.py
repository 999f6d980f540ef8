"""baton/stack_sampler.py: the sampling profiler of a worker's Python threads (BATON_STACK_SAMPLES)."""

from __future__ import annotations

import threading
import time

from baton import stack_sampler
from baton.stack_sampler import Sampler


def _spin_in_a_known_place(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(200))


def test_a_busy_thread_s_function_leads_its_group_and_the_collapsed_stacks():
    stop = threading.Event()
    t = threading.Thread(target=_spin_in_a_known_place, args=(stop,), name="busy-7")
    t.start()
    s = Sampler(0.002).start()
    deadline = time.monotonic() + 10
    while s.samples["busy"] < 40 and time.monotonic() < deadline:  # (a loaded machine samples less often)
        time.sleep(0.05)
    s.stop()
    stop.set()
    t.join()
    assert s.samples["busy"] >= 40, s.samples  # the group: the name without its counter
    report = s.report()
    section = report.split("## busy:")[1].split("\n## ")[0]
    own = dict(x.rsplit(" ", 1) for x in section.split("self: ")[1].split("\n")[0].split(", "))
    assert float(own["test_stack_sampler.py:_spin_in_a_known_place"].rstrip("%")) >= 50, section  # mostly there
    assert "test_stack_sampler.py:_spin_in_a_known_place 100.0%" in section.split("total: ")[1], section
    line = next(ln for ln in report.splitlines() if ln.startswith("busy;"))
    assert "_spin_in_a_known_place" in line and int(line.rsplit(" ", 1)[1]) >= 1
    assert "baton-stack-sampler" not in s.samples  # it never samples itself


def test_off_unless_asked_and_written_where_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(stack_sampler.ENV, raising=False)
    assert stack_sampler.start("prefill") is None and stack_sampler.write() is None
    monkeypatch.setenv(stack_sampler.ENV, str(tmp_path / "stacks-{role}-{pid}.txt"))
    monkeypatch.setenv(stack_sampler.INTERVAL_ENV, "1")
    s = stack_sampler.start("decode")
    assert s is not None and stack_sampler.start("decode") is s  # once a process
    time.sleep(0.05)
    path = stack_sampler.write()
    assert path is not None and path.startswith(str(tmp_path / "stacks-decode-"))
    text = open(path).read()
    assert text.startswith("# stack samples every 1 ms") and "## MainThread:" in text
    assert stack_sampler.write() is None  # stopped: nothing more to write


def test_the_sampling_cost_bench_reports_a_sample_s_cost(tmp_path, capsys):
    """benchmarks/bench_stack_sampler.py: the time of one sample over parked threads, and its share of the
    default period (what the module doc's overhead figure comes from)."""
    import json

    from benchmarks import bench_stack_sampler as bench

    out = tmp_path / "s.json"
    assert bench.main(["--threads", "6", "--depth", "10", "--samples", "20", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == r and r["benchmark"] == "bench_stack_sampler"
    assert r["threads"] == 6 and 0 < r["ms_per_sample"] < 50
    assert abs(r["share_at_default_period"] - r["ms_per_sample"] / bench.DEFAULT_PERIOD_MS) < 1e-3
