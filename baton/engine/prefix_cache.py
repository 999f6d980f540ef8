"""PrefixCache: the prefill worker's states of prompt prefixes, for later prompts that begin with them.

Why it is exact. A prompt is always cut into pieces at multiples of the runner's prefill chunk from its start
(baton/engine/prefill.py: PREFILL_CHUNK, 8192 tokens; a prefill worker's --prefill-piece where cut_check
finds that cutting there changes no bit), and its state after each piece is a function of its
tokens so far alone (docs/CONTRACTS.md, batched prefill). So the state after the first k pieces of one prompt
is bitwise the state after the first k pieces of any prompt with the same first k * chunk tokens. A later
prompt starts from a copy of it and computes only its remaining pieces: its state, first token and every
token after are bitwise what computing all of its pieces gives, as equal prompts in one pass are
(prefill.shared_pieces).

An entry, one per boundary b = k * chunk of a cached prompt (c = chunk, E = entries, P = PAGE):
    GDN state    every GDN layer's conv and recurrent state after row b - 1: row `row` of the cache's store,
                 conv[layer] [E, conv_dim, KW-1] and recurrent[layer] [E, Hv, dk, dv] fp32 (allocated once)
    KV           rows [b - c, b) of every attention layer and of the MTP layer: c / P whole pages lent by the
                 runner's PagePool (PagePool.lend); an entry's KV is its own chunk's, so a hit needs entries
                 1..k all present (a chain)
    key          a 16-byte blake2b digest of tokens [0, b), chained chunk by chunk from the request's cache_salt
                 (none: the shared chain), and the token at b: the MTP layer's pair of row b - 1 ends with that
                 token, and the next piece begins with it
Restoring k entries (`restore`): the slot is zeroed as a fresh prompt's slot is (HybridState.reset_slots), the
chain's pages are copied into the slot's pages [0, b / P), entry k's GDN row into the slot; the caller records
tokens [0, b) into the slot's token history (penalties) and runs the prompt's pieces from b.

Lifecycle and eviction (least recently used first):
    insert(slot, keys, k)   after a pass computed a prompt's piece ending at boundary k + 1 that is not its
                            last, its parents keys[:k] cached: a free row and c / P pages (evicting others)
    restore(slot, keys)     before a prompt's first piece: the longest cached chain of its boundary_keys;
                            and in a pass, a piece whose end another prompt's earlier pass cached (have=)
    reclaim(n)              PagePool.ensure found n pages short for a request: entries evicted until n pages
                            are free or the cache is empty, so cached prefixes never refuse a request
A hit or an insert touches its chain from the leaf to the root, so a parent is always more recently used than
each of its children: eviction takes leaves first, and every cached entry's chain stays whole.
Threads: one lock. restore and insert run under the worker's compute lock; their device copies go on the one
stream every pass uses, so a page evicted and handed to a request is rewritten only after the copies that read it.

An entry made by a pass that skipped the MTP layer's KV (a fast bf16 session's prefill) serves prefills that
skip it too; a pass that writes it completes the entry (the rest of its state is the same).
Not cached: a prompt's last piece (its last MTP pair needs the token it picks), prompts whose boundaries are
not whole pages (chunk % PAGE != 0).
Not restored: prompts that ask for prompt logprobs (every row's hidden state is needed). Off when the window
holds no more than one piece (no prompt has a boundary before its end).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from baton.engine.pages import PAGE
from baton.transfer import upload

DEFAULT_PREFIX_ENTRIES = 16  # boundaries cached when the window exceeds one piece: ~0.8 GB of GDN state at the 9B shape


@dataclass
class Entry:
    row: int  # its GDN state's row in the cache's store
    pages: list[int]  # its chunk's KV pages, lent by the pool
    mtp: bool  # they hold the MTP layer's KV too (its pass wrote it); a prefill without it may still use it


def boundary_keys(ids: list[int], chunk: int, salt: str = "") -> list[bytes]:
    """A prompt's boundary keys: one per b = k * chunk < len(ids), k = 1, 2, ...: a 16-byte blake2b digest of
    ids[0:b], chained chunk by chunk, and ids[b] (module doc). Equal keys: equal states after b (the pieces
    are cut there). salt (a request's cache_salt): the chain starts from it, so salted prompts share entries
    (and passes' pieces, prefill.shared_pieces) only with their salt."""
    out = []
    digest = hashlib.blake2b(b"salt\0" + salt.encode(), digest_size=16).digest() if salt else b""
    for b in range(chunk, len(ids), chunk):
        digest = hashlib.blake2b(digest + array("i", ids[b - chunk : b]).tobytes(), digest_size=16).digest()
        out.append(digest + int(ids[b]).to_bytes(4, "little"))
    return out


def entries_for(max_len: int, chunk: int, asked: int | None) -> int:
    """The entries a worker keeps: `asked` when given (0: off), else DEFAULT_PREFIX_ENTRIES when the window
    holds more than one piece and the piece is whole pages, else 0 (nothing could be cached)."""
    if asked is not None:
        if asked < 0:
            raise ValueError(f"prefix_cache: {asked} entries; must be >= 0")
        return int(asked)
    return DEFAULT_PREFIX_ENTRIES if max_len > chunk and chunk % PAGE == 0 else 0


class PrefixCache:
    def __init__(self, state, chunk: int, entries: int):
        if entries < 1:
            raise ValueError(f"prefix cache: {entries} entries; must be >= 1")
        if chunk % PAGE:
            raise ValueError(f"prefix cache: a piece of {chunk} tokens is not whole pages of {PAGE}")
        self.state, self.chunk, self.capacity = state, int(chunk), int(entries)
        self.pages_per_entry = self.chunk // PAGE
        z = lambda t: torch.zeros((entries, *t.shape[1:]), dtype=t.dtype, device=t.device)  # noqa: E731
        self.conv = {i: z(t) for i, t in state.conv.items()}
        self.recurrent = {i: z(t) for i, t in state.recurrent.items()}
        self._lru: OrderedDict[bytes, Entry] = OrderedDict()  # oldest first
        self._rows = list(range(entries - 1, -1, -1))
        self._lock = threading.Lock()
        self.hits = self.tokens_reused = self.inserted = self.evicted = 0
        self.reclaimed = 0  # of the evicted, those a request's pages took (reclaim)
        state.pages.reclaim = self.reclaim

    def bytes(self) -> int:
        """Device bytes of the GDN store (the KV is in lent pages of the pool)."""
        return sum(t.numel() * t.element_size() for d in (self.conv, self.recurrent) for t in d.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    # ---- use -----------------------------------------------------------------------------------
    def restore(self, slot: int, keys: list[bytes], mtp: bool = True, have: int = 0) -> int:
        """The longest cached chain of the prompt's boundary keys into the slot (its pages reserved for the
        prompt) -> the slot's tokens after it (have, the slot untouched, when the chain ends there or before).
        mtp: the prefill writes the MTP layer's KV (only entries that hold it serve); mtp=False: it is left
        zero, as a prefill without it leaves it. have: tokens the slot computed already (a multiple of the
        chunk: its pieces so far, the same states as the chain's entries), so a prompt whose next piece was
        cached by another prompt's pass meanwhile skips it (ExactEngine._prefill_batch); the slot is then
        restored whole, as at its start."""
        mtp = mtp and self.state.mtp_layer is not None
        with self._lock:
            chain: list[Entry] = []
            for key in keys:
                if (e := self._lru.get(key)) is None or (mtp and not e.mtp):
                    break
                chain.append(e)
            if len(chain) * self.chunk <= have:
                return have
            self._touch(keys[: len(chain)])
            st, b = self.state, len(chain) * self.chunk
            st.reset_slots([slot])
            layers = [i for i in st.attn_ids if mtp or i != st.mtp_layer]
            self._copy_pages([p for e in chain for p in e.pages], st.pages.owned(slot)[: b // PAGE], layers)
            row = chain[-1].row
            for i in st.conv:
                st.conv[i][slot].copy_(self.conv[i][row])
                st.recurrent[i][slot].copy_(self.recurrent[i][row])
            self.hits += 1
            self.tokens_reused += b - have
            return b

    def insert(self, slot: int, keys: list[bytes], k: int, mtp: bool = True) -> bool:
        """The slot's state after its prompt's boundary k + 1 (a pass just computed the piece ending there)
        as keys[k]'s entry, its parents keys[:k] cached. mtp: the pass wrote the MTP layer's KV (an entry
        without it gets it now). -> True if added or completed (False: present already, a parent missing, or
        no row / pages to be had without evicting the chain itself)."""
        key, chain = keys[k], keys[:k]
        mtp = mtp and self.state.mtp_layer is not None
        with self._lock:
            if (e := self._lru.get(key)) is not None:
                self._touch(keys[: k + 1])
                if mtp and not e.mtp:  # the same state: only the MTP layer's rows are new
                    own = self.state.pages.owned(slot)[k * self.pages_per_entry : (k + 1) * self.pages_per_entry]
                    self._copy_pages(own, e.pages, [self.state.mtp_layer])
                    e.mtp = True
                    return True
                return False
            if any(p not in self._lru for p in chain):
                return False
            keep = set(chain)
            while not self._rows and self._evict_oldest(keep):
                pass
            pages = self.state.pages.lend(self.pages_per_entry)
            while pages is None and self._evict_oldest(keep):
                pages = self.state.pages.lend(self.pages_per_entry)
            if not self._rows or pages is None:
                if pages is not None:
                    self.state.pages.give_back(pages)
                return False
            st, row = self.state, self._rows.pop()
            own = st.pages.owned(slot)[k * self.pages_per_entry : (k + 1) * self.pages_per_entry]
            self._copy_pages(own, pages, st.attn_ids)
            for i in st.conv:
                self.conv[i][row].copy_(st.conv[i][slot])
                self.recurrent[i][row].copy_(st.recurrent[i][slot])
            self._lru[key] = Entry(row, pages, mtp)
            self._touch(keys[: k + 1])
            self.inserted += 1
            return True

    def reclaim(self, n: int) -> int:
        """PagePool.reclaim: evicts entries, oldest first, until n pages went back or none is left -> pages freed."""
        freed = 0
        with self._lock:
            while freed < n and self._lru:
                freed += self._evict(next(iter(self._lru)))
                self.reclaimed += 1
        return freed

    def clear(self) -> None:
        with self._lock:
            while self._lru:
                self._evict(next(iter(self._lru)))

    def stats(self) -> dict:
        with self._lock:
            return {
                "entries": len(self._lru),
                "pages": len(self._lru) * self.pages_per_entry,
                "hits": self.hits,
                "tokens_reused": self.tokens_reused,
                "inserted": self.inserted,
                "evicted": self.evicted,
                "reclaimed": self.reclaimed,
            }

    # ---- inside the lock -------------------------------------------------------------------------
    def _touch(self, chain: list[bytes]) -> None:
        for key in reversed(chain):  # the root last: the most recently used
            self._lru.move_to_end(key)

    def _evict_oldest(self, keep: set) -> bool:
        for key in self._lru:
            if key not in keep:
                self._evict(key)
                return True
        return False

    def _evict(self, key: bytes) -> int:
        e = self._lru.pop(key)
        self._rows.append(e.row)
        self.state.pages.give_back(e.pages)
        self.evicted += 1
        return len(e.pages)

    def _copy_pages(self, src: list[int], dst: list[int], layers) -> None:
        st = self.state
        si, di = upload(src, torch.long, st.device), upload(dst, torch.long, st.device)
        for i in layers:
            for pool in (st.key[i], st.value[i]):
                pool.index_copy_(0, di, pool.index_select(0, si))


def restore_pieces(cache: PrefixCache, history, pieces: list) -> set[int]:
    """Of a pass's pieces (baton/engine/prefill.py: Piece), under the compute lock before the pass: those whose
    end state an earlier pass of another prompt cached after this prompt began (the two out of step: its
    start's restore found nothing then), each restored into its slot instead of computed (restore with have =
    its start), its tokens put in the slot's token history (history: penalties.History) and marked
    `restored`. -> their indices in `pieces` (the pass computes the others). Not for a piece that asks for
    prompt logprobs (each row's hidden state is needed), nor a prompt's last piece (never cached)."""
    done = set()
    for i, p in enumerate(pieces):
        if p.prefix is None or p.prompt_logprobs >= 0:
            continue
        keys, k = p.prefix
        if cache.restore(p.slot, keys[: k + 1], p.mtp, have=p.start) > p.start:
            history.put(p.slot, p.ids, p.start)
            p.restored = True
            done.add(i)
    return done
