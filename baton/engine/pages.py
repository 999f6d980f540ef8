"""PagePool: the attention layers' KV pages of one HybridState, a free list and a per-slot page table.

Layout (P = pages, S = slots, MP = max_pages = ceil(max_len / PAGE)):
    HybridState.key/value[layer]  [P + 1, kv_heads, PAGE, head_dim] per attention layer (and the MTP
                                  layer); page P is the sink (below), never handed out
    table                         [S, MP] int32 on the device: KV row `pos` of slot s lives in page
                                  table[s, pos // PAGE] at row pos % PAGE, in every attention layer
                                  (one page id stands for the same page of every layer's pool)
A page holds PAGE = 256 keys: the split-window attention (baton/kernels/attention.py) reduces a row's
keys in fixed 256-key pieces, so piece s of a row is exactly page table[slot, s]; reading through the
table changes no value and no reduction order (bitwise the contiguous window of before).
PagedRows: a received KV tensor's destination, the slot's pages (HybridState.import_views).

Lifecycle of a slot's pages:
    ensure(slot, tokens)  a session is admitted for `tokens` positions (prefill: its prompt, plus the
                          tokens it will decode when known; LoadState: its position + 1; Decode: position
                          + max_new_tokens + speculation rows; rows / Draft: grown at the step boundary):
                          the slot gets pages [owned, ceil(tokens / PAGE)) from the free list, all or none;
                          raises PagesExhausted (RESOURCE_EXHAUSTED) before any work when too few are free
    free(slot)            every end of a session (release, cancel, TTL reap, replace / migration, a
                          failed hand-off: SlotTable's on_free hook): its pages go back to the free list and
                          its table row points at the sink again
Pages may also be lent outside the slots (`lend` / `give_back`: the prefill worker's prefix cache,
baton/engine/prefix_cache.py, keeps the KV of cached prompt prefixes in them). A lender may register
`reclaim(n)`: when ensure() finds fewer than n more pages free, it asks the lender to give back at least
that many first (the cache evicts its least recently used entries), so lent pages never refuse a request.
Invariants: a page is in exactly one place, the free list, one slot's list or the lent set; a slot's table row holds
its pages in order, then the sink. Unowned entries point at the sink page, so a stray write (never
expected: every write is at a position < the reserved tokens) can only land in the sink, never in
another session's page; the sink is only ever read masked (eager path, positions past a row's own).
Table writes are device copies on the current stream, issued between steps (never inside a capture),
so a step enqueued before them reads the old table and one enqueued after reads the new one.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from baton.engine.gpu_plan import agreed_budget
from baton.engine.slots import SessionLimit
from baton.transfer import upload

PAGE = 256  # keys per page = baton.kernels.attention.ATTN_SPLIT (checked there)


class PagesExhausted(SessionLimit):
    """Too few free KV pages for a new request: RESOURCE_EXHAUSTED (as SessionLimit)."""


def pages_for(tokens: int) -> int:
    """Pages that hold KV rows [0, tokens)."""
    return -(-max(int(tokens), 0) // PAGE)


def pages_from_memory(free_bytes: int, fraction: float, page_bytes: int, cap: int) -> int:
    """The pool size for a memory budget (like vLLM's gpu_memory_utilization): pages of page_bytes in
    fraction x free_bytes, at most cap (every slot's full window), at least 1."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"gpu_memory_fraction: {fraction} must be in (0, 1]")
    return max(1, min(int(cap), int(free_bytes * fraction) // max(int(page_bytes), 1)))


DEFAULT_GPU_MEMORY_FRACTION = 0.9  # of the free GPU memory at start-up, for the KV pages of every runner


def page_bytes_of(cfg, dtype: torch.dtype, mtp: bool) -> int:
    """Bytes of one page in every attention layer's key and value pool (the MTP layer's when mtp)."""
    layers = len(cfg.attn_layers) + int(mtp)
    return 2 * layers * cfg.num_key_value_heads * PAGE * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()


def o1_bytes_of(cfg, slots: int, dtype: torch.dtype, copies: int = 1) -> int:
    """Bytes of the O(1) GDN state of `slots` slots, `copies` times (ping-pong, checkpoints: estimate)."""
    item = torch.empty(0, dtype=dtype).element_size()
    conv = cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * item
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return len(cfg.gdn_layers) * (conv + rec) * slots * copies


def kept_inputs_bytes_of(cfg, dtype: torch.dtype, rows: int) -> int:
    """Bytes a fused runner's batched rows passes keep to replay cut verify blocks (fused_blocks.BatchedRows:
    each GDN layer's conv input, beta and alpha, and one zero gate, at `rows` rows): ~100 MB at the 9B shape."""
    item = torch.empty(0, dtype=dtype).element_size()
    per_row = len(cfg.gdn_layers) * (cfg.conv_dim + 2 * cfg.linear_num_value_heads) + cfg.value_dim
    return rows * per_row * item


def attention_scratch_bytes_of(cfg, rows: int, max_len: int) -> int:
    """Bytes of the split-window attention's fp32 partials at `rows` rows over a max_len window
    (baton/kernels/split_scratch.py, sized by the window's pieces, or by N with BATON_ATTN_PROGRAM_PARTIALS=N):
    one buffer a runner, which all its calls share (~85 MB at 320 rows of the 9B over 4,096 tokens, ~3.1 GB
    over 150,000), so a long window's KV sizing leaves room for it (on 2026-12-07 a 150,200-token window on an
    H100 ran out of memory capturing)."""
    from baton.kernels.split_scratch import partial_slots, split_scratch_bytes

    return split_scratch_bytes(rows, cfg.num_attention_heads, partial_slots(pages_for(max_len)), cfg.head_dim)


def graph_bytes_of(cfg, dtype: torch.dtype, device, max_len: int, *, runners: int = 1, kept: bool = True) -> int:
    """What a worker's captured graphs hold besides the pages and the O(1) state, for its KV sizing: on CUDA
    each of its `runners`' attention partials and (kept) one runner's batched-verify GDN inputs
    (fused_blocks.BatchedRows.replay_kept), at MAX_ROWS rows, the largest pass the graphs take; 0 elsewhere."""
    if torch.device(device).type != "cuda":
        return 0
    from baton.engine.fused_blocks import MAX_ROWS

    scratch = runners * attention_scratch_bytes_of(cfg, MAX_ROWS, max_len)
    return scratch + (kept_inputs_bytes_of(cfg, dtype, MAX_ROWS) if kept else 0)


def choose_pages(
    device,
    *,
    page_bytes: int,
    slots: int,
    max_len: int,
    runners: int = 1,
    reserved_bytes: int = 0,
    kv_pages: int | None = None,
    fraction: float = DEFAULT_GPU_MEMORY_FRACTION,
    gpu_workers: int = 1,
    gpu_plan: str | None = None,
    extra_pages: int = 0,
) -> int | None:
    """Pages of each runner's pool: kv_pages when given; on CUDA, fraction x the free memory now, less
    reserved_bytes (the O(1) state still to be allocated), shared by `runners` pools, at most every slot's
    full window + extra_pages; on CPU None (slots x the window: every slot can always hold a full window), or
    that + extra_pages. extra_pages: what the pool may lend beyond the slots' windows (the prefill worker's
    prefix cache entries' KV), so that a full set of sessions does not take the cached prefixes' pages (on
    2026-12-07 a pool capped at 8 windows restored 4 of 16 prompts sharing a 17K-token prefix). On CUDA a
    budget that cannot hold one full window raises ValueError at start-up (like vLLM's KV-cache check),
    instead of a server that refuses every long request with RESOURCE_EXHAUSTED.
    gpu_workers > 1 with gpu_plan (workers placed on one GPU: Settings.gpu_workers / gpu_plan): the budget
    the workers agreed (baton/engine/gpu_plan.py): an equal share of fraction x total less every worker's
    fixed bytes, whichever starts first."""
    if kv_pages is not None:
        if kv_pages < 1:
            raise ValueError(f"kv_pages: {kv_pages} must be >= 1")
        return int(kv_pages)
    dev = torch.device(device)
    if dev.type != "cuda":
        return slots * pages_for(max_len) + extra_pages if extra_pages else None
    free, total = torch.cuda.mem_get_info(dev)
    agreed = None
    if gpu_workers > 1 and gpu_plan:
        held = torch.cuda.memory_reserved(dev)
        agreed = agreed_budget(gpu_plan, gpu_workers, held + reserved_bytes, total, fraction)
    budget = agreed if agreed is not None else max(int(free * fraction) - reserved_bytes, 0)
    budget //= max(runners, 1)
    pages = pages_from_memory(budget, 1.0, page_bytes, slots * pages_for(max_len) + extra_pages)
    if pages < pages_for(max_len):  # not one request of the window would ever be admitted: say so now
        source = (
            f"{fraction} of the {free / 2**30:.1f} GiB free on {dev}, less {reserved_bytes / 2**30:.1f} GiB still "
            "to be allocated (the O(1) state, the attention's partials over the window, the graphs' kept inputs)"
            if agreed is None
            else f"the share of {fraction} x {total / 2**30:.1f} GiB on {dev} agreed by {gpu_workers} workers "
            f"(baton/engine/gpu_plan.py: all their weights and O(1) state first)"
        )
        raise ValueError(
            f"KV pages: {source}, leaves {pages} pages of {PAGE} tokens per runner ({runners}), less than one "
            f"window of {max_len} tokens ({pages_for(max_len)} pages): free GPU memory (another process holds "
            "it?), raise --gpu-memory-fraction, lower --max-len, or set --kv-pages"
        )
    return pages


def describe(pages: int, page_bytes: int, slots: int, max_len: int, scratch=None) -> str:
    """The start-up line: what the pool holds (pages, tokens, GiB, full windows), and the runner's attention
    partials when it has them (scratch: HybridState.attn_scratch, sized by the window: GiB at long ones)."""
    line = f"KV pages: {pages} x {PAGE} tokens = {pages * PAGE} tokens ({pages * page_bytes / 2**30:.2f} GiB), "
    line += f"{pages // max(pages_for(max_len), 1)} full windows of {max_len} for {slots} slots"
    gib = None if scratch is None else scratch.numel() * scratch.element_size() / 2**30
    return line if gib is None else f"{line}; attention partials {gib:.2f} GiB"


def fill_capacity(out, runners) -> None:
    """Sets a WorkerStats' capacity fields (slots, kv_pools, kv_pages, kv_pages_free, kv_page_tokens) from the
    worker's runners (runners that share one state, bf16 and mtp, count once). `slots` is each runner's."""
    states = list({id(r.state): r.state for r in runners}.values())
    out.slots = max((st.slots for st in states), default=0)
    out.kv_pools = len(states)
    out.kv_pages = sum(st.pages.pages for st in states)
    out.kv_pages_free = sum(st.pages.free_pages for st in states)
    out.kv_page_tokens = PAGE


class PagePool:
    def __init__(self, pages: int, slots: int, max_pages: int, device):
        if pages < 1:
            raise ValueError(f"kv_pages: {pages} must be >= 1")
        self.pages, self.slots, self.max_pages = int(pages), int(slots), int(max_pages)
        self.sink = self.pages  # the pools hold pages + 1 pages; the last is the sink
        self.table = torch.full((slots, max_pages), self.sink, dtype=torch.int32, device=device)
        self._lock = threading.Lock()
        self._free = list(range(self.pages - 1, -1, -1))  # pop() hands out low ids first
        self._owned: list[list[int]] = [[] for _ in range(slots)]
        self._lent: set[int] = set()  # pages lent outside the slots (lend / give_back)
        self.reclaim: Callable[[int], object] | None = None  # reclaim(n): the lender gives back >= n pages if it can

    @property
    def free_pages(self) -> int:
        with self._lock:
            return len(self._free)

    def owned(self, slot: int) -> list[int]:
        """The slot's pages, in position order (a copy)."""
        with self._lock:
            return list(self._owned[slot])

    def capacity(self, slot: int) -> int:
        """Tokens the slot's pages hold."""
        with self._lock:
            return len(self._owned[slot]) * PAGE

    @property
    def lent_pages(self) -> int:
        with self._lock:
            return len(self._lent)

    def lend(self, n: int) -> list[int] | None:
        """n pages from the free list, held outside the slots until give_back; None (nothing taken) when
        fewer are free. Never reclaims: a lender takes only what no request needs now."""
        with self._lock:
            if n > len(self._free):
                return None
            out = [self._free.pop() for _ in range(n)]
            self._lent.update(out)
            return out

    def give_back(self, pages: list[int]) -> None:
        """Lent pages back to the free list."""
        with self._lock:
            if not self._lent.issuperset(pages):
                raise ValueError("give_back: a page that was not lent")
            self._lent.difference_update(pages)
            self._free.extend(reversed(pages))

    def ensure(self, slot: int, tokens: int) -> list[int]:
        """The slot's pages cover positions [0, tokens) (tokens <= max_pages * PAGE); -> the pages newly
        added (the caller zeroes them). All or none: PagesExhausted leaves everything as it was (but lent
        pages the lender gave back on the way stay free)."""
        need = pages_for(tokens)
        if need > self.max_pages:
            raise ValueError(f"{tokens} tokens exceed the window of {self.max_pages * PAGE} tokens")
        with self._lock:
            short = need - len(self._owned[slot]) - len(self._free)
        if short > 0 and self.reclaim is not None:  # outside the lock: the lender's give_back takes it
            self.reclaim(short)
        with self._lock:
            own = self._owned[slot]
            more = need - len(own)
            if more <= 0:
                return []
            if more > len(self._free):
                raise PagesExhausted(
                    f"KV pages exhausted: {tokens} tokens need {more} more pages of {PAGE} tokens, "
                    f"{len(self._free)} of {self.pages} are free"
                )
            new = [self._free.pop() for _ in range(more)]
            start = len(own)
            own.extend(new)
            # on the current stream, as every reader of the table (passes, graph replays, the hand-off's
            # gathers) and free()'s fill_: a pinned non-blocking copy, not a blocking one that waited for
            # every pass already queued (baton/transfer.py)
            self.table[slot, start:need].copy_(upload(new, torch.int32, self.table.device))
        return new

    def free(self, slot: int) -> int:
        """All of the slot's pages back to the free list; -> how many."""
        with self._lock:
            own = self._owned[slot]
            n = len(own)
            if n:
                self._free.extend(reversed(own))
                self._owned[slot] = []
                self.table[slot, :n].fill_(self.sink)
            return n

    def check(self) -> None:
        """The invariant (tests): every page is free, owned by one slot, or lent, exactly once."""
        with self._lock:
            seen = list(self._free) + [p for own in self._owned for p in own] + list(self._lent)
            assert sorted(seen) == list(range(self.pages)), "a KV page is lost or held twice"


class PagedRows:
    """The import destination of one KV tensor [kv_heads, position, head_dim] of a slot: its pages.
    copy_(src) / fill_(value) write rows [0, position) into the slot's pages on the current stream (a
    host source is copied to the device first, non_blocking from pinned memory). The full pages take one
    index_copy_ / index_fill_ together and the last, partial page one copy: a handful of torch calls
    whatever the length (a 16K state's KV took ~200 a tensor, one a page, each a GIL hand-over).
    `shared`: a dict the PagedRows of one slot's import share (HybridState.import_views), so the device
    list of its full pages is uploaded once for every layer's key and value."""

    def __init__(self, pool: torch.Tensor, pages: list[int], position: int, shared: dict | None = None):
        self.pool, self.pages, self.position = pool, pages, position  # pages cover [0, position)
        self.shape = (pool.shape[1], position, pool.shape[3])
        self._shared = {} if shared is None else shared

    def _full(self) -> tuple[int, torch.Tensor | None]:
        """(full pages n, their ids on the pool's device [n] or None when n = 0)."""
        n = self.position // PAGE
        if n == 0:
            return 0, None
        key = (self.pool.device, n)
        idx = self._shared.get(key)
        if idx is None:
            idx = self._shared[key] = upload(self.pages[:n], torch.long, self.pool.device)
        return n, idx

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> "PagedRows":
        src = src.to(self.pool.device, non_blocking=non_blocking)
        n, idx = self._full()
        if n:  # [H, n * PAGE, D] -> [n, H, PAGE, D], page j of the source into pool[pages[j]]
            self.pool.index_copy_(0, idx, src[:, : n * PAGE].unflatten(1, (n, PAGE)).transpose(0, 1))
        rest = self.position - n * PAGE
        if rest:
            self.pool[self.pages[n], :, :rest].copy_(src[:, n * PAGE :])
        return self

    def fill_(self, value) -> "PagedRows":
        n, idx = self._full()
        if n:
            self.pool.index_fill_(0, idx, value)
        rest = self.position - n * PAGE
        if rest:
            self.pool[self.pages[n], :, :rest].fill_(value)
        return self


class PagedSource:
    """The export side of PagedRows: one KV tensor [kv_heads, position, head_dim] of a slot as a hand-off
    source, read in place from its pages (the ids taken when it is made) rather than gathered into a new
    tensor first. The stager copies address_ranges() D2H through the GIL-holding launcher
    (baton/handoff/staging.py: stage_into): no torch call, so no GIL hand-over beside the prefill's thread
    (a lazy gather was ~8 torch calls a tensor, 18 tensors a 9B hand-off). gather() makes the contiguous
    tensor (HybridState.slot_rows' values) for a stager that cannot copy by address.
    Lifetime: the pages must stay the slot's, unwritten at rows [0, position), until the copies are done,
    as for any view of the state (the prefill keeps its session until the hand-off ends)."""

    requires_grad = False
    is_cuda = property(lambda self: self.pool.is_cuda)
    device = property(lambda self: self.pool.device)
    dtype = property(lambda self: self.pool.dtype)

    def __init__(self, pool: torch.Tensor, pages: list[int], position: int):
        if not pool.is_contiguous():
            raise ValueError("PagedSource: the page pool must be contiguous")
        if len(pages) < pages_for(position):
            raise ValueError(f"PagedSource: {len(pages)} pages do not hold {position} rows")
        self.pool, self.pages, self.position = pool, list(pages[: pages_for(position)]), int(position)
        self.shape = (pool.shape[1], self.position, pool.shape[3])

    def numel(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2]

    def element_size(self) -> int:
        return self.pool.element_size()

    def gather(self) -> torch.Tensor:
        """The rows as one contiguous tensor [kv_heads, position, head_dim] (device copies, current stream)."""
        return rows_of(self.pool, [self.pages], self.position)[0]

    def address_ranges(self, a: int, b: int) -> list[tuple[int, int]]:
        """Bytes [a, b) of the tensor's C-order layout as (device address, length) pieces, in order: head h's
        rows of page j are one contiguous run of the pool (pool[pages[j], h, :rows])."""
        row = self.shape[2] * self.element_size()  # bytes of one key row
        head = self.position * row  # bytes of one head's rows in the tensor
        page_stride, head_stride = (s * self.element_size() for s in self.pool.stride()[:2])
        base, out = self.pool.data_ptr(), []
        for h in range(a // head if head else 0, -(-b // head) if head else 0):
            for j, page in enumerate(self.pages):
                lo = h * head + j * PAGE * row  # the run's bytes in the tensor: [lo, lo + n)
                n = min(PAGE, self.position - j * PAGE) * row
                s, e = max(lo, a), min(lo + n, b)
                if s >= e:
                    continue
                at = base + page * page_stride + h * head_stride + (s - lo)
                if out and out[-1][0] + out[-1][1] == at:
                    out[-1] = (out[-1][0], out[-1][1] + e - s)
                else:
                    out.append((at, e - s))
        return out


def rows_of(pool: torch.Tensor, pages: list[list[int]], length: int) -> torch.Tensor:
    """KV rows [0, length) of several slots gathered from one pool in one index_select: pages[j] is slot j's
    page ids in position order (PagePool.owned: at least pages_for(length) of them) -> [b, kv_heads, length,
    head_dim], slot j's rows HybridState.slot_rows' values (a prefill pass's pieces of one shape attending
    together: baton/models/prefill_attention.py)."""
    k, (_, heads, _, d) = pages_for(length), pool.shape
    ids = upload([p for ps in pages for p in ps[:k]], torch.long, pool.device)
    g = pool.index_select(0, ids).view(len(pages), k, heads, PAGE, d)  # [b, k, H, PAGE, d]
    return g.transpose(1, 2).reshape(len(pages), heads, k * PAGE, d)[:, :, :length].contiguous()
