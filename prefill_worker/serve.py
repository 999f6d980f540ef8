"""serve_prefill: builds a prefill worker (model -> ModelRunner -> ExactEngine -> warm-up -> PrefillServicer
-> gRPC server) and reports SERVING once all of it is done."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from baton import grammar
from baton.engine.exact_rounds import arrange_exact_rounds
from baton.engine.pages import (
    DEFAULT_GPU_MEMORY_FRACTION,
    PAGE,
    choose_pages,
    describe,
    graph_bytes_of,
    o1_bytes_of,
    page_bytes_of,
    pages_for,
)
from baton.engine.prefill import PREFILL_CHUNK, cut_check
from baton.engine.prefix_cache import entries_for
from baton.engine.runner import DEFAULT_MAX_LEN, DEFAULT_WIDTH, ModelRunner
from baton.handoff.wire import DEFAULT_CHUNK_BYTES, check_chunk_bytes
from baton.loading import LoadedModel, load_model
from baton.settings import Settings
from baton.v1 import prefill_pb2_grpc
from baton.worker.options import DEFAULT_SLOTS, DEFAULT_TTL_S, default_dtype
from baton.worker.process import WorkerHandle, start_serving, worker_threads
from prefill_worker.engine import PREFILL_BUDGET, ExactEngine
from prefill_worker.service import SERVICE, PrefillServicer

log = logging.getLogger("baton.prefill")


def prepare_cuda(runner: ModelRunner):
    """The exact engine's CUDA runner made ready to serve: batching on (concurrent sessions' verify blocks
    share one pass, baton/engine/fused_blocks.py) and the graphs captured: rows n = 1..W (AR steps,
    verify blocks n = K+1, re-advances n = m+1) and the batched blocks, greedy and sampled, and their cut
    blocks' replays. -> GraphStats."""
    from baton.engine.graph import MAX_DRAFT, block_keys, capture_all

    runner.enable_batching()
    blocks = block_keys(runner, MAX_DRAFT + 1)
    ns = {"rows": range(1, runner.width + 1), "rowsb": blocks, "rowsbs": blocks, "replay": blocks}
    return capture_all(runner, ns=ns)


def serve_prefill(
    model: str | Path | LoadedModel | None,
    *,
    host: str | None = None,
    port: int = 0,
    device: str = "cpu",
    dtype: str | None = None,
    width: int = DEFAULT_WIDTH,
    max_len: int = DEFAULT_MAX_LEN,
    slots: int = DEFAULT_SLOTS,
    ttl_s: float = DEFAULT_TTL_S,
    settings: Settings | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_workers: int | None = None,
    max_concurrent_rpcs: int = 256,
    kv_pages: int | None = None,
    gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION,
    prefill_budget: int | None = None,
    prefix_cache: int | None = None,
    prefill_piece: int | None = None,
) -> tuple[WorkerHandle, PrefillServicer]:
    """Loads the model (with its MTP head when the checkpoint has one, so prefill fills the MTP KV),
    builds runner + ExactEngine + server; health turns SERVING once everything is ready.
    kv_pages: the KV pool's pages (baton/engine/pages.py); None: on CUDA gpu_memory_fraction of the free
    memory (at most slots x the window + the prefix cache's pages), on CPU exactly that. prefill_budget: prompt tokens a batched
    prefill pass may hold (None: PREFILL_BUDGET). prefix_cache: prompt prefixes kept, one a piece boundary
    (baton/engine/prefix_cache.py; 0: off; None: DEFAULT_PREFIX_ENTRIES when the window exceeds one piece).
    prefill_piece: the pieces prompts are cut into (a multiple of PAGE; None: PREFILL_CHUNK), and so the prefix
    cache's boundaries; taken only if cut there a prompt ends bitwise as in PREFILL_CHUNK pieces on this device
    (baton/engine/prefill.py cut_check, at start-up), else PREFILL_CHUNK with a warning."""
    settings = Settings.from_env() if settings is None else settings
    check_chunk_bytes(chunk_bytes, settings.max_message_bytes)  # NOTE: before the model loads
    if isinstance(model, LoadedModel):
        lm = model
    else:
        log.info("prefill: loading %s (%s, %s)", model, device, dtype or default_dtype(device))
        lm = load_model(model, dtype=dtype or default_dtype(device), device=device, mtp=None)
    page_b = page_bytes_of(lm.cfg, lm.model.model.embed_tokens.weight.dtype, lm.has_mtp)
    piece = prefill_piece or PREFILL_CHUNK
    if piece < 1 or piece % PAGE:
        raise ValueError(f"prefill_piece: {piece} tokens is not a positive multiple of the {PAGE}-token page")
    entries = entries_for(max_len, piece, prefix_cache)
    cache_pages = entries * pages_for(piece)  # the prefix cache's KV, beside every slot's full window
    pages = choose_pages(
        device,
        page_bytes=page_b,
        slots=slots,
        max_len=max_len,
        reserved_bytes=o1_bytes_of(lm.cfg, 2 * slots + width + entries, torch.float32)
        + graph_bytes_of(lm.cfg, lm.model.model.embed_tokens.weight.dtype, device, max_len),
        kv_pages=kv_pages,
        fraction=gpu_memory_fraction,
        gpu_workers=settings.gpu_workers,
        gpu_plan=settings.gpu_plan,
        extra_pages=cache_pages,
    )
    runner = ModelRunner(lm.model, slots=slots, max_len=max_len, width=width, checkpoints=True, kv_pages=pages)
    log.info(
        "prefill: %s",
        describe(runner.state.pages.pages, runner.state.page_bytes(), slots, max_len, runner.state.attn_scratch),
    )
    if str(device).startswith("cuda"):
        st = prepare_cuda(runner)
        log.info("prefill: captured %d CUDA graphs in %.1fs", st.graphs, st.seconds)
    if prefill_piece:  # (else the runner's own pieces: PREFILL_CHUNK)
        runner.prefill_chunk = checked_piece(runner, piece, max_len - width - 1)
        entries = min(entries, entries_for(max_len, runner.prefill_chunk, prefix_cache))  # (a failed check: 8192)
    piece = runner.prefill_chunk
    engine = ExactEngine(runner, ttl_s=ttl_s, prefill_budget=prefill_budget or PREFILL_BUDGET, prefix_entries=entries)
    if engine.prefix is not None:
        log.info(
            "prefill: prefix cache: %d boundaries of %d tokens (GDN state %.2f GiB; their KV in idle pages, up to %d "
            "sized beside the slots' windows, given back to requests that need them)",
            entries,
            piece,
            engine.prefix.bytes() / 2**30,
            cache_pages,
        )
    else:
        why = "--prefix-cache 0" if prefix_cache == 0 else f"the window of {max_len} holds one {piece}-token piece"
        log.info("prefill: prefix cache off (%s)", why)
    arrange_exact_rounds(engine.verifies, device, settings.gpu_workers, log, "prefill")
    log.info("prefill: batched passes of up to %d prompt tokens (pieces of %d)", engine.prefills.budget, piece)
    if str(device).startswith("cuda"):
        log.info("prefill: warm-up prefills (compiles the wide prefill kernels) ...")
        log.info("prefill: warm-up done in %.1fs", engine.warm_up())
    engine.grammars = grammar.source(lm.model_dir, lm.cfg.vocab_size, lm.cfg.eos_token_ids)
    servicer = PrefillServicer(engine, fingerprint=lm.fingerprint, settings=settings, chunk_bytes=chunk_bytes)
    if servicer.sender is not None:
        servicer.sender.start()  # spawned now: the first hand-off does not wait for it
    handle = start_serving(
        servicer,
        prefill_pb2_grpc.add_PrefillWorkerServicer_to_server,
        SERVICE,
        host=host,
        port=port,
        settings=settings,
        max_workers=max_workers or worker_threads(slots),  # None: sized to the sessions
        max_concurrent_rpcs=max(max_concurrent_rpcs, 4 * slots),
    )
    log.info(
        "prefill: ready on %s (slots=%d, max_len=%d, W=%d, mtp=%s)",
        handle.address,
        slots,
        max_len,
        width,
        runner.has_mtp,
    )
    return handle, servicer


def checked_piece(runner, piece: int, room: int) -> int:
    """The piece size the worker cuts prompts into: `piece` when cutting there leaves a prompt's state bitwise
    as PREFILL_CHUNK pieces do on this device (cut_check on a prompt of two pieces and a part, as far as the
    window allows), else PREFILL_CHUNK, with a warning naming what differs."""
    if piece == PREFILL_CHUNK:
        return piece
    tokens = min(2 * piece + 301, room)
    if tokens <= piece:  # no prompt the window holds is cut there: nothing to check, nothing to change
        return piece
    t0 = time.perf_counter()
    differ = cut_check(runner, piece, tokens)
    if differ:
        log.warning(
            "prefill: --prefill-piece %d not taken: on this device a %d-token prompt cut there differs from %d-token "
            "pieces (%s); pieces of %d",
            piece,
            tokens,
            PREFILL_CHUNK,
            ", ".join(differ[:4]) + (", ..." if len(differ) > 4 else ""),
            PREFILL_CHUNK,
        )
        return PREFILL_CHUNK
    log.info(
        "prefill: pieces of %d tokens: a %d-token prompt cut there ends bitwise as in %d-token pieces on this device "
        "(checked in %.1fs)",
        piece,
        tokens,
        PREFILL_CHUNK,
        time.perf_counter() - t0,
    )
    return piece
