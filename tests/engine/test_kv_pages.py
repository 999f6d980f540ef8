"""Paged KV (baton/engine/pages.py): the free list and page table, the state's export / import through
shuffled pages, and the engines freeing a session's pages on every end (release, generate's end, TTL
reap, replace, a failed fill) and refusing a session the pool cannot hold before any work.
Invariant checked throughout: every page is free or held by exactly one slot (PagePool.check)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import make_tiny_dir

from baton.engine.gpu_plan import agreed_budget, read_fixed
from baton.engine.pages import (
    PAGE,
    PagedRows,
    PagePool,
    PagesExhausted,
    choose_pages,
    pages_for,
    pages_from_memory,
)
from baton.engine.runner import ModelRunner, WindowError
from baton.engine.slots import SessionLimit
from baton.loading import load_model
from decode_worker.engine import DecodeEngine
from prefill_worker.engine import ExactEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MAX_LEN = 3 * PAGE  # three pages a window


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_model(make_tiny_dir(tmp_path_factory.mktemp("m")), dtype="fp32")


# ---------------------------------------------------------------- the pool
def test_pool_hands_out_pages_all_or_none_and_takes_them_back():
    p = PagePool(5, slots=3, max_pages=3, device="cpu")
    assert p.ensure(0, 1) == [0] and p.ensure(0, PAGE) == [] and p.ensure(0, PAGE + 1) == [1]
    assert p.table[0].tolist() == [0, 1, p.sink] and p.capacity(0) == 2 * PAGE
    assert p.ensure(1, 2 * PAGE) == [2, 3]
    with pytest.raises(PagesExhausted, match="KV pages exhausted.*need 2 more pages.*1 of 5 are free"):
        p.ensure(2, 2 * PAGE)  # all or none: nothing taken
    assert p.free_pages == 1 and p.owned(2) == [] and p.table[2].tolist() == [p.sink] * 3
    assert isinstance(PagesExhausted("x"), SessionLimit)  # RESOURCE_EXHAUSTED wherever SessionLimit is
    with pytest.raises(ValueError, match="window"):
        p.ensure(2, 3 * PAGE + 1)
    p.check()
    assert p.free(0) == 2 and p.table[0].tolist() == [p.sink] * 3 and p.free(0) == 0
    assert p.ensure(2, 3 * PAGE) == [0, 1, 4]  # the last freed first, then any: the table maps them
    p.check()
    assert pages_for(0) == 0 and pages_for(1) == 1 and pages_for(PAGE) == 1 and pages_for(PAGE + 1) == 2


@pytest.mark.parametrize("position", [0, 5, PAGE, PAGE + 7, 3 * PAGE, 3 * PAGE + 1])
def test_paged_rows_write_exactly_rows_below_position_into_the_slot_pages(position):
    H, D = 2, 3
    pool = torch.full((6, H, PAGE, D), -1.0)
    pages = [4, 1, 5, 0]  # out of order: page j of the rows is pool[pages[j]]
    shared: dict = {}
    src = torch.randn(H, position, D)
    PagedRows(pool, pages, position, shared).copy_(src)
    want = torch.full_like(pool, -1.0)
    for j in range(pages_for(position)):
        a, b = j * PAGE, min(position, (j + 1) * PAGE)
        want[pages[j], :, : b - a] = src[:, a:b]
    assert torch.equal(pool, want)  # nothing past position, and no page that is not the slot's, written
    other = torch.full_like(pool, -1.0)
    PagedRows(other, pages, position, shared).fill_(0.0)  # the full pages' ids: uploaded once, reused
    assert torch.equal(other, torch.where(want == -1.0, want, torch.zeros_like(want)))
    assert len(shared) == (1 if position >= PAGE else 0)


def test_sizing_from_memory_and_the_cpu_default():
    assert pages_from_memory(10 * 1000, 0.5, 1000, cap=100) == 5
    assert pages_from_memory(10**12, 0.9, 1000, cap=64) == 64  # never more than every slot's full window
    with pytest.raises(ValueError, match="gpu_memory_fraction"):
        pages_from_memory(1, 0.0, 1, 1)
    assert choose_pages("cpu", page_bytes=1, slots=4, max_len=1000) is None  # slots x window
    assert choose_pages("cpu", page_bytes=1, slots=4, max_len=1000, kv_pages=7) == 7
    # the prefill worker's prefix cache lends pages beside every slot's full window
    assert choose_pages("cpu", page_bytes=1, slots=4, max_len=1000, extra_pages=64) == 4 * pages_for(1000) + 64


def test_cuda_sizing_refuses_a_budget_below_one_window(monkeypatch):
    """On CUDA the pool comes from the free memory now; if it cannot hold one window of max_len the worker
    stops at start-up with what to change, instead of refusing every such request later."""
    free = {"b": 100 * 2**20}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (free["b"], 2 * free["b"]))
    page_b = 2**20  # 1 MiB a page
    # 0.5 x 100 MiB - 10 MiB reserved = 40 pages; a window of 10 * PAGE tokens needs 10
    assert (
        choose_pages("cuda", page_bytes=page_b, slots=8, max_len=10 * PAGE, reserved_bytes=10 * 2**20, fraction=0.5)
        == 40
    )
    assert choose_pages("cuda", page_bytes=page_b, slots=2, max_len=10 * PAGE, fraction=0.5) == 20  # the cap
    cap = choose_pages("cuda", page_bytes=page_b, slots=2, max_len=10 * PAGE, fraction=0.5, extra_pages=7)
    assert cap == 27  # the cap grows by the prefix cache's pages while memory allows (50 pages here)
    free["b"] = 30 * 2**20  # another process holds the rest: 0.5 x 30 MiB - 10 MiB = 5 pages < 10
    with pytest.raises(ValueError, match=r"leaves 5 pages .* less than one window of 2560 tokens \(10 pages\)") as e:
        choose_pages("cuda", page_bytes=page_b, slots=8, max_len=10 * PAGE, reserved_bytes=10 * 2**20, fraction=0.5)
    assert "less 0.0 GiB still to be allocated (the O(1) state, the attention's partials" in str(e.value)


def test_the_sizing_counts_the_attention_partials_the_kernel_allocates_over_the_window(monkeypatch):
    """attention_rows allocates fp32 partials for every piece of the page table's width (the window), not the
    rows' positions: a captured graph's pool keeps them, so the KV sizing must count them (on 2026-12-07 a
    150,200-token window on an H100 ran out of memory capturing). The bytes the kernel asks torch.empty for
    are attention_scratch_bytes_of's, and the workers add them to what the pages must leave."""
    from baton.engine import pages as pages_mod
    from baton.kernels import attention
    from baton.random_init import shape

    cfg = shape("qwen3.5-9b")
    rows, max_len = 40, 3 * PAGE + 5
    asked = []

    class Stop(Exception):
        pass

    real_empty = torch.empty

    def empty(*shape, **kw):
        if kw.get("dtype") == torch.float32:
            asked.append(real_empty(0, dtype=torch.float32).element_size() * torch.Size(*shape).numel())
            if len(asked) == 2:
                raise Stop
        return real_empty(*shape, **kw)

    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    kc = torch.zeros(8, nkv, PAGE, d, dtype=torch.bfloat16)
    table = torch.zeros(3, pages_for(max_len), dtype=torch.int32)
    q, gate = torch.zeros(rows, nh, d, dtype=torch.bfloat16), torch.zeros(rows, nh, d, dtype=torch.bfloat16)
    monkeypatch.setattr(attention.torch, "empty", empty)
    with pytest.raises(Stop):
        attention.attention_rows(
            q,
            kc,
            kc.clone(),
            torch.zeros(rows, dtype=torch.long),
            gate,
            rows,
            table=table,
            slots=torch.zeros(4, dtype=torch.long),
            gs=10,
        )
    monkeypatch.undo()
    assert sum(asked) == pages_mod.attention_scratch_bytes_of(cfg, rows, max_len)
    # ~3.1 GB at 320 rows over 150,200 tokens: more than the 10% a 0.9 fraction leaves on an 80 GB H100 / 2
    assert pages_mod.attention_scratch_bytes_of(cfg, 320, 150_200) == 320 * nh * pages_for(150_200) * (d + 2) * 4
    from baton.engine.fused_blocks import MAX_ROWS

    def graphs(device, window, **kw):  # what both workers' sizings reserve for their graphs
        return pages_mod.graph_bytes_of(cfg, torch.bfloat16, device, window, **kw)

    assert graphs("cpu", 150_200) == 0  # the CPU captures no graphs
    grown = graphs("cuda", 150_200) - graphs("cuda", 4096)
    assert grown == pages_mod.attention_scratch_bytes_of(cfg, MAX_ROWS, 150_200) - (
        pages_mod.attention_scratch_bytes_of(cfg, MAX_ROWS, 4096)
    )
    # two runners (bf16 + fp8), one of them keeping its verify's GDN inputs: a scratch each, the inputs once
    two = graphs("cuda", 4096, runners=2) - graphs("cuda", 4096, runners=2, kept=False)
    assert two == pages_mod.kept_inputs_bytes_of(cfg, torch.bfloat16, MAX_ROWS)
    assert graphs("cuda", 4096, runners=2, kept=False) == 2 * pages_mod.attention_scratch_bytes_of(cfg, MAX_ROWS, 4096)


def test_a_runner_scratch_serves_each_calls_partials_as_views_and_a_small_one_is_never_overrun(monkeypatch):
    """split_buffers hands a call views of the runner's scratch (the bytes the kernel would allocate, at its
    start: every call of the runner reuses the same memory) and allocates its own when the scratch is too
    small; runner_scratch reserves nothing on the CPU, whatever BATON_ATTN_SCRATCH says."""
    from baton.kernels import split_scratch as sc
    from baton.random_init import shape

    rows, nh, ns, d = 6, 4, 3, 16
    scratch = torch.zeros(sc.split_scratch_bytes(rows, nh, ns, d) // 4)
    acc, ml = sc.split_buffers(rows, nh, ns, d, scratch.device, scratch)
    assert (acc.shape, ml.shape) == ((rows, nh, ns, d), (rows, nh, ns, 2))
    assert acc.data_ptr() == scratch.data_ptr() and ml.data_ptr() == acc.data_ptr() + 4 * acc.numel()
    acc2, _ = sc.split_buffers(2, nh, ns, d, scratch.device, scratch)  # fewer rows: the same memory
    assert acc2.data_ptr() == scratch.data_ptr()
    big_acc, big_ml = sc.split_buffers(rows + 1, nh, ns, d, scratch.device, scratch)  # more rows: its own
    ends = scratch.data_ptr(), scratch.data_ptr() + 4 * scratch.numel()
    assert not ends[0] <= big_acc.data_ptr() < ends[1] and not ends[0] <= big_ml.data_ptr() < ends[1]
    for env in ("1", "0", None):
        if env is None:
            monkeypatch.delenv(sc.SCRATCH_ENV, raising=False)
        else:
            monkeypatch.setenv(sc.SCRATCH_ENV, env)
        assert sc.runner_scratch("cpu", shape("qwen3.5-9b"), 150_000) is None


def test_workers_sharing_a_gpu_agree_on_their_budgets(monkeypatch, tmp_path):
    """Two workers on one GPU (BATON_GPU_WORKERS=2, BATON_GPU_PLAN): each writes its fixed bytes (weights
    held + O(1) state to come), waits for the other's, and takes half of fraction x total less both, so the
    split is the same whichever sizes first, and a decode worker that holds more (an FP8 copy) is not left
    short. From free memory alone the first took 90% of what the other had not loaded yet (the H100's
    decode worker: 41 pages); an equal share of the total less its own weights refused to start it."""
    gib, page_b = 2**30, 2**20
    total = 80 * gib
    held = {"prefill-0": 18 * gib, "decode-0": 27 * gib}
    reserved = {"prefill-0": 4 * gib, "decode-0": 11 * gib}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (1 * gib, total))  # free: whatever, unused
    me = threading.local()
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: held[me.name])
    kw = dict(page_bytes=page_b, slots=10**6, max_len=4 * PAGE, fraction=0.9, gpu_workers=2)
    got = {}

    def size(name, delay):
        me.name = name
        time.sleep(delay)
        got[name] = choose_pages("cuda", reserved_bytes=reserved[name], gpu_plan=str(tmp_path / name), **kw)

    for delays in ((0.0, 0.3), (0.3, 0.0)):  # either worker first
        for f in tmp_path.iterdir():
            f.unlink()
        ts = [threading.Thread(target=size, args=(n, d)) for n, d in zip(held, delays)]
        [t.start() for t in ts]
        [t.join(10) for t in ts]
        want = (int(0.9 * total) - sum(held.values()) - sum(reserved.values())) // 2 // page_b
        assert got == {"prefill-0": want, "decode-0": want}, (delays, got)
    # a plan that leaves less than one window says so, naming the plan (not the free memory)
    (tmp_path / "prefill-0").write_text(str(60 * gib))
    me.name = "decode-0"
    with pytest.raises(ValueError, match=r"agreed by 2 workers .* leaves 1 pages"):
        choose_pages("cuda", reserved_bytes=reserved["decode-0"], gpu_plan=str(tmp_path / "decode-0"), **kw)
    # the other worker never writes: the plan gives up and the worker sizes from free memory, as alone
    (tmp_path / "prefill-0").unlink()
    me.name = "decode-0"
    assert agreed_budget(str(tmp_path / "decode-0"), 2, 1, total, 0.9, timeout_s=0.2) is None
    assert read_fixed(str(tmp_path)) == {"decode-0": 1}


# ---------------------------------------------------------------- the state through pages
def _scatter_pages(r: ModelRunner, slots=(0, 1), n=3) -> None:
    """Interleaved growth: the slots' pages alternate in the pool, so no slot's table is the identity."""
    for k in range(1, n + 1):
        for s in slots:
            r.reserve(s, k * PAGE)


def test_export_import_round_trip_through_shuffled_pages(lm):
    """A state prefilled in pages [1, 3, 5] of one runner, moved into pages [0, 2, 4] of another, exports
    the same [kv_heads, position, head_dim] rows and decodes the same tokens as the source."""
    src, dst = (ModelRunner(lm.model, slots=2, max_len=MAX_LEN) for _ in range(2))
    _scatter_pages(src, (0, 1))
    _scatter_pages(dst, (1, 0))
    ids = torch.randint(0, lm.cfg.vocab_size, (PAGE + 40,), generator=torch.Generator().manual_seed(1)).tolist()
    nxt = src.prefill(1, ids)
    assert src.state.pages.owned(1) == [1, 3, 5] and dst.state.pages.owned(0) == [1, 3, 5]
    ex = {t.name: t.tensor.clone() for t in src.state.export(1)}
    kv = [n for n in ex if n.endswith((".key", ".value"))]
    assert kv and all(ex[n].shape[1] == len(ids) for n in kv)
    dst.state.release_pages(1)  # dst slot 1 gives its pages back; slot 0 keeps [1, 3, 5]: remap it
    dst.state.release_pages(0)
    dst.reserve(1, PAGE)  # a page for slot 1 first: slot 0's import lands in other pages than the source's
    dst.state.import_(0, ex, position=len(ids), next_token=nxt)
    assert dst.state.pages.owned(0)[0] != src.state.pages.owned(1)[0]
    back = {t.name: t.tensor for t in dst.state.export(0)}
    assert all(torch.equal(back[n], ex[n]) for n in ex)
    lazy = dst.state.export(0, lazy=True)  # the streaming prefill's export: gathered on materialize()
    assert all(t.tensor.device.type == "meta" for t in lazy if t.gather is not None)
    assert all(torch.equal(t.materialize(), ex[t.name]) for t in lazy)
    a = [src.rows(1, [nxt])[0] for _ in range(3)]
    b = [dst.rows(0, [nxt])[0] for _ in range(3)]
    assert a == b
    for r in (src, dst):
        r.state.pages.check()


def test_a_request_over_the_model_ceiling_is_a_window_error(lm):
    r = ModelRunner(lm.model, max_len=MAX_LEN)
    with pytest.raises(WindowError):
        r.check_window(MAX_LEN, 1)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelRunner(lm.model, max_len=lm.cfg.max_position_embeddings + 1)


# ---------------------------------------------------------------- the exact engine
def test_exact_engine_frees_pages_on_every_end_and_refuses_before_work(lm, monkeypatch):
    r = ModelRunner(lm.model, slots=3, max_len=MAX_LEN, kv_pages=3)
    eng = ExactEngine(r, ttl_s=60)
    pool = r.state.pages
    s, _ = eng.prefill([5] * (PAGE + 1))  # two pages
    assert len(pool.owned(s.slot)) == 2 and pool.free_pages == 1
    with pytest.raises(PagesExhausted):  # a new prompt of two pages: refused, no session left behind
        eng.prefill([6] * (PAGE + 1))
    assert eng.session_count() == 1 and pool.free_pages == 1
    with pytest.raises(PagesExhausted):  # generate reserves its whole window before the prefill
        eng.generate([7] * 10, 300)
    assert eng.session_count() == 1 and pool.free_pages == 1
    assert eng.release(s.id) and pool.free_pages == 3
    out = eng.generate([7] * 10, 5)  # ... and frees it at the end
    assert len(out) == 5 and pool.free_pages == 3
    s, _ = eng.prefill([8] * 3)
    monkeypatch.setattr(eng._table, "ttl_s", -1.0)
    assert eng.reap_expired() == 1 and pool.free_pages == 3  # TTL reap
    pool.check()


# ---------------------------------------------------------------- the decode engine
def _exported(lm, n: int):
    src = ModelRunner(lm.model, max_len=MAX_LEN)
    nxt = src.prefill(0, [3] * n)
    return {t.name: t.tensor.clone() for t in src.state.export(0)}, n, nxt


def test_decode_engine_frees_pages_on_release_replace_reap_and_failed_fill(lm, monkeypatch):
    r = ModelRunner(lm.model, slots=3, max_len=MAX_LEN, kv_pages=4)
    eng = DecodeEngine({"bf16": r}, default_engine="bf16", batch_steps=False)
    pool = r.state.pages
    tensors, pos, nxt = _exported(lm, PAGE + 5)
    s = eng.load(tensors, position=pos, next_token=nxt, session_id="a")
    assert len(pool.owned(s.slot)) == 2
    toks = [t for b in eng.decode("a", 3) for t in b]
    assert len(toks) == 3 and len(pool.owned(s.slot)) == 2
    s2 = eng.load(tensors, position=pos, next_token=nxt, session_id="a")  # replace (migration, retry)
    assert eng.session_count() == 1 and pool.free_pages == 2 and len(pool.owned(s2.slot)) == 2
    pool.check()
    fill = eng.reserve(None, "b", pos)  # a hand-off that fails: its slot and pages come back
    assert pool.free_pages == 0
    with pytest.raises(PagesExhausted, match="KV pages"):  # nothing left for a third state
        eng.reserve(None, "c", 5)
    with pytest.raises(PagesExhausted):  # a Decode that would need pages it cannot have: refused first
        next(eng.decode("a", 300))
    assert int(r.state.position[s2.slot]) == pos and len(pool.owned(s2.slot)) == 2  # untouched
    fill.abort()
    assert pool.free_pages == 2 and eng.session_count() == 1
    assert [t for b in eng.decode("a", 300) for t in b]  # with the pages back, it runs
    assert eng.release("a") and pool.free_pages == 4
    eng.load(tensors, position=pos, next_token=nxt, session_id="d")
    monkeypatch.setattr(eng._table, "ttl_s", -1.0)
    assert eng.reap_expired() == 1 and pool.free_pages == 4
    pool.check()


def test_steps_outside_decode_grow_pages_across_a_page_boundary(lm):
    """ar_step / ar_batch / rows called directly (tests, benchmarks) reserve the row they consume, so two
    sessions crossing a page boundary never share the sink page: each equals itself alone."""
    alone = []
    for slot in (0, 1):
        r = ModelRunner(lm.model, slots=2, max_len=MAX_LEN)
        r.prefill(slot, [slot + 3] * (PAGE - 2))
        alone.append([r.ar_step(slot) for _ in range(5)])
    both = ModelRunner(lm.model, slots=2, max_len=MAX_LEN)
    for slot in (0, 1):
        both.prefill(slot, [slot + 3] * (PAGE - 2))
    got = [[], []]
    for _ in range(5):
        for slot in (0, 1):
            got[slot].append(both.ar_step(slot))
    assert got == alone and all(len(both.state.pages.owned(s)) == 2 for s in (0, 1))
    both.prefill(0, [3] * (PAGE - 2))  # the same prompt again; ar_batch crosses the boundary for both
    both.prefill(1, [4] * (PAGE - 2))
    steps = [both.ar_batch([0, 1]) for _ in range(5)]
    assert [[t[0] for t in steps], [t[1] for t in steps]] == alone
    both.state.pages.check()


def test_held_bytes_count_the_pages_a_slot_owns_not_its_window(lm):
    """WorkerStats.session_bytes: a slot's O(1) state plus the pages it holds (a short prompt in a
    three-page window holds one page)."""
    r = ModelRunner(lm.model, slots=2, max_len=MAX_LEN, width=8)
    st = r.state
    assert st.held_bytes(0) == st.o1_slot_bytes()
    r.prefill(0, [1, 2, 3])
    assert st.held_bytes(0) == st.o1_slot_bytes() + st.page_bytes() < st.slot_bytes()
    r.prefill(1, list(range(PAGE + 5)))
    assert st.held_bytes(1) == st.o1_slot_bytes() + 2 * st.page_bytes()


def test_the_start_up_line_names_the_pool_and_the_attention_partials():
    """pages.describe: the pool's pages, tokens, GiB and full windows; with a runner's scratch (CUDA), its GiB."""
    from baton.engine.pages import describe

    line = describe(40, 2**20, slots=8, max_len=10 * PAGE)
    assert line == f"KV pages: 40 x {PAGE} tokens = {40 * PAGE} tokens (0.04 GiB), 4 full windows of 2560 for 8 slots"
    scratch = torch.empty(2**28, dtype=torch.float32)  # 1 GiB
    assert describe(40, 2**20, 8, 10 * PAGE, scratch) == line + "; attention partials 1.00 GiB"
