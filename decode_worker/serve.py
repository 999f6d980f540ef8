"""serve_decode: builds a decode worker (model -> runners -> FP8 copy -> CUDA graphs -> DecodeEngine ->
DecodeServicer -> gRPC server) and reports SERVING once all of it is done."""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

import torch

from baton import grammar
from baton.engine.exact_rounds import arrange_exact_rounds
from baton.engine.pages import (
    DEFAULT_GPU_MEMORY_FRACTION,
    choose_pages,
    describe,
    graph_bytes_of,
    o1_bytes_of,
    page_bytes_of,
)
from baton.engine.runner import DEFAULT_MAX_LEN, DEFAULT_WIDTH, ModelRunner
from baton.engine.speculation import GREEDY, Drafter
from baton.loading import LoadedModel, load_model
from baton.settings import Settings
from baton.worker.options import DEFAULT_SLOTS, DEFAULT_TTL_S, default_dtype
from baton.worker.process import WorkerHandle, start_serving, worker_threads
from decode_worker.engine import ENGINES, DecodeEngine
from decode_worker.service import DEFAULT_MTP_K, SERVICE, DecodeServicer, add_to_server

log = logging.getLogger("baton.decode")


def available_engines(lm: LoadedModel, wanted=ENGINES) -> tuple[str, ...]:
    """`wanted` filtered to what this checkpoint and install support: mtp needs the checkpoint's MTP
    head; fp8 needs decode_worker.fp8 (quantize_model)."""
    out = []
    for e in wanted:
        if e not in ENGINES:
            raise ValueError(f"engines: unknown engine {e!r}; choose from {', '.join(ENGINES)}")
        if e == "mtp" and not lm.has_mtp:
            log.warning("decode: no MTP head in the checkpoint, engine mtp disabled")
        elif e == "fp8" and _fp8_module() is None:
            log.warning("decode: decode_worker.fp8 is not importable, engine fp8 disabled")
        elif e not in out:
            out.append(e)
    return tuple(out)


def _fp8_module():
    try:
        from decode_worker import fp8
    except ImportError:
        return None
    return fp8 if hasattr(fp8, "quantize_model") else None


def serve_decode(
    model: str | Path | LoadedModel | None,
    *,
    engines=ENGINES,
    default_engine: str | None = None,
    host: str | None = None,
    port: int = 0,
    device: str = "cpu",
    dtype: str | None = None,
    width: int = DEFAULT_WIDTH,
    max_len: int = DEFAULT_MAX_LEN,
    slots: int = DEFAULT_SLOTS,
    ttl_s: float = DEFAULT_TTL_S,
    settings: Settings | None = None,
    capture_graphs: bool = True,
    fp8_mode: str = "full",
    mtp_k: int = DEFAULT_MTP_K,
    mtp_draft_length: str = "adaptive",
    max_workers: int | None = None,
    max_concurrent_rpcs: int = 256,
    pipeline: bool = False,
    drafter: Drafter | None = None,
    kv_pages: int | None = None,
    gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION,
) -> tuple[WorkerHandle, DecodeServicer]:
    """Loads the model, builds one runner for bf16 + mtp (BF16 model with its MTP head) and one for fp8
    (an FP8 copy), captures CUDA graphs (cuda only), serves; health SERVING once all of that is done.
    pipeline (default off): bf16 / fp8 sessions each alone in the pipelined AR loop (ModelRunner(pipeline=True),
    one more GDN state per slot; no batching); tokens identical. Off: every bf16 / fp8 session steps
    together through the step scheduler (on CUDA the bucketed batched step, fused_batch.BatchedAR).
    mtp sessions never pipeline; the exact engine (prefill worker, `baton complete`) stays plain.
    drafter: chooses the draft tokens (baton.engine.speculation.Drafter; None = the model's own greedy).
    kv_pages: each runner's KV pages (baton/engine/pages.py); None: on CUDA sized from gpu_memory_fraction
    of the free memory (shared by the runners, at most slots x the window), on CPU slots x the window."""
    settings = Settings.from_env() if settings is None else settings
    if isinstance(model, LoadedModel):
        lm = model
    else:
        log.info("decode: loading %s (%s, %s)", model, device, dtype or default_dtype(device))
        lm = load_model(model, dtype=dtype or default_dtype(device), device=device, mtp=None)
    names = available_engines(lm, engines)
    default_engine = (default_engine or names[0]) if names else default_engine
    if default_engine not in names:
        raise ValueError(f"engine: {default_engine!r} is not available here (have {', '.join(names) or 'none'})")
    runners: dict[str, ModelRunner] = {}
    fp8_model = None
    if "fp8" in names:  # before any runner: the KV pool is sized from the memory left after both models
        log.info("decode: quantizing an FP8 copy of the model (%s)", fp8_mode)
        fp8_model = copy.deepcopy(lm.model)
        if hasattr(fp8_model, "mtp"):
            del fp8_model.mtp  # fp8 sessions never draft with the MTP head
        _fp8_module().quantize_model(fp8_model, fp8_mode)
    shares = int("bf16" in names or "mtp" in names) + int(fp8_model is not None)
    act = lm.model.model.embed_tokens.weight.dtype
    page_b = page_bytes_of(lm.cfg, act, lm.has_mtp and "mtp" in names)
    # the bf16 runner's batched verify keeps its GDN inputs (BatchedRows.replay_kept), unless pipelined
    kept = not pipeline and ("bf16" in names or "mtp" in names)
    graphs = graph_bytes_of(lm.cfg, act, device, max_len, runners=shares, kept=kept)
    pages = choose_pages(
        device,
        page_bytes=page_b,
        slots=slots,
        max_len=max_len,
        runners=shares,
        reserved_bytes=shares * o1_bytes_of(lm.cfg, 3 * slots + width, torch.float32) + graphs,
        kv_pages=kv_pages,
        fraction=gpu_memory_fraction,
        gpu_workers=settings.gpu_workers,
        gpu_plan=settings.gpu_plan,
    )
    if "bf16" in names or "mtp" in names:
        shared = ModelRunner(
            lm.model,
            slots=slots,
            max_len=max_len,
            width=width,
            checkpoints="mtp" in names,
            pipeline=pipeline and "bf16" in names,
            kv_pages=pages,
        )
        runners.update({e: shared for e in ("bf16", "mtp") if e in names})
    if fp8_model is not None:
        runners["fp8"] = ModelRunner(
            fp8_model, slots=slots, max_len=max_len, width=width, pipeline=pipeline, kv_pages=pages
        )
    for e, r in {id(r): (e, r) for e, r in runners.items()}.values():
        st = r.state
        log.info("decode: %s runner %s", e, describe(st.pages.pages, st.page_bytes(), slots, max_len, st.attn_scratch))
    if str(device).startswith("cuda") and not pipeline:  # bf16 / fp8 sessions step together (BatchedAR),
        for e in ("bf16", "fp8", "mtp"):  # mtp rounds chain and verify together (BatchedRows)
            if e in runners:
                runners[e].enable_batching()
    if capture_graphs and str(device).startswith("cuda"):
        _capture(runners)
    engine = DecodeEngine(
        runners,
        default_engine=default_engine,
        ttl_s=ttl_s,
        drafter=drafter or GREEDY,
        batch_steps=False if pipeline else None,
        draft_length=mtp_draft_length,
    )
    arrange_exact_rounds(engine.drafts, device, settings.gpu_workers, log, "decode")
    sessions = slots * len({id(r) for r in runners.values()})  # bf16 and mtp share a runner
    engine.grammars = grammar.source(lm.model_dir, lm.cfg.vocab_size, lm.cfg.eos_token_ids)
    servicer = DecodeServicer(engine, fingerprint=lm.fingerprint, settings=settings, mtp_k=mtp_k)
    handle = start_serving(
        servicer,
        add_to_server,
        SERVICE,
        host=host,
        port=port,
        settings=settings,
        max_workers=max_workers or worker_threads(sessions),  # None: sized to the sessions
        max_concurrent_rpcs=max(max_concurrent_rpcs, 4 * sessions),
    )
    log.info(
        "decode: ready on %s (engines=%s, default=%s, slots=%d, max_len=%d, W=%d)",
        handle.address,
        ",".join(names),
        default_engine,
        slots,
        max_len,
        width,
    )
    return handle, servicer


def _capture(runners: dict[str, ModelRunner]) -> None:
    try:
        from baton.engine import graph
    except ImportError:
        log.warning("decode: baton.engine.graph not available; running eagerly (no CUDA graphs)")
        return
    for r in {id(r): r for r in runners.values()}.values():
        t0 = time.perf_counter()
        graph.capture_all(r)
        log.info("decode: captured CUDA graphs in %.1fs", time.perf_counter() - t0)
