"""TTFT benchmark: prefill alone vs prefill + state hand-off to a decode worker over loopback gRPC, and
prefill MFU. Batch 1; for each prompt length T, the median of --runs after --warmup rounds (the two paths
alternate, so drift on a busy host hits both alike):

    prefill_s           ExactEngine.prefill of the prefill worker (a direct call; CUDA synchronized):
                        the time to the first token without a split
    split_s             the real Prefill RPC (prefill_worker/service.py, mode FAST) naming a real decode
                        worker (decode_worker/service.py); each serves on its own gRPC server on
                        127.0.0.1 with the bearer-token interceptor on. --decode-worker process (the
                        default, the deployed topology): the decode worker is `python -m decode_worker`
                        in its own process (same weights: --random-init/--seed or the same checkpoint,
                        so the fingerprints agree), so its receive path does not compete with prefill
                        for this process's GIL; in-process: it serves from this process (one copy of
                        the weights); "process,in-process" measures both, interleaved. The state
                        streams (wire format 4) to the decode worker's LoadState while prefill computes:
                        each layer goes out once its CUDA event completes (baton/handoff/progress.py); LoadState
                        verifies every chunk, places each tensor into a reserved slot and activates it
                        only after the manifest verified. Timed on the client until the answer is back
                        and the device is idle: the decode worker holds the state and its first Decode
                        step can run
    handoff_s           the sender's BridgeReport seconds (stream start -> LoadState answered; the stream
                        starts before the compute, so this overlaps prefill); handoff_GBps = state_bytes /
                        handoff_s; handoff_wall_s = split_s - the server's prefill_seconds (time to the
                        first token): the hand-off time the split adds, Prefill RPC included
    split_overhead_pct  100 * (split_s / prefill_s - 1)
    tail_ms             where the split's time after the prefill goes: the hand-off's timeline (each split's
                        PrefillRequest asks for it; --no-timeline: not asked, no tail_* fields), each mark of
                        baton/handoff/timeline.py as ms after prefill.compute_end (the prefill has the first token:
                        logits on the host, its last stage marked final), the median over --runs, ordered by
                        it; negative = before. Marks (process.mark; baton/handoff/timeline.py says exactly where each
                        is stamped): prefill.rpc_start / last_layer_enqueued / compute_end; the last data
                        chunk staged into the sender's ring (prefill.last_chunk_ready, _slot, _staged) and
                        END posted (prefill.end_posted); in the sender child: that chunk read, submitted to
                        the framing pool, framed + hashed, handed to gRPC, sent (sender.last_chunk_*), END
                        read, the trailer handed / sent; at the decode worker: the header, the last chunk out
                        of gRPC (decode.last_chunk_received), fed to the receiver, the trailer, every hash +
                        the manifest verified (decode.verified), the stream closed, the last tensor's H2D
                        queued, receive_state done (decode.received), the state in its slot with its device
                        copies done (decode.loaded), the answer (decode.reply); the answer at the sender
                        (sender.reply) and in the prefill's process (prefill.reply_received), the Prefill
                        answer (prefill.rpc_reply), and here (client.reply, stamped by this benchmark). The
                        thread sender has no staging and child marks. Clock: time.monotonic_ns =
                        CLOCK_MONOTONIC, which every process of a host shares, so the marks of the prefill
                        worker, its sender child and the decode worker process compare directly with no
                        clock sync (the transit between them included); each process reports its clock's id
                        (boot_id), tail_clock_shared says they matched (else only the prefill's marks are kept).
                        Its cost: a few clock reads per chunk, and on CUDA LoadState waits for what commit
                        queued after its own wait for the H2D copies (finish_import) before answering, which
                        the decode worker process's answer does not wait for otherwise; --no-timeline
                        measures without it
    tail_ms_runs        each run's offsets (mark -> [ms per run]): the run-to-run spread, mark by mark
    tail_backlog        data chunks not yet past each stage when the prefill ended, median over runs:
                        prefill.staged (into the ring), sender.handed (to gRPC), decode.received (out of
                        gRPC at the decode worker); of data_chunks
    tail_ordered        every run's marks keep the orders causality imposes (baton.handoff.timeline.CHAINS); a
                        breakdown per combination is printed to stderr (median ms, step from the mark above)
    mfu                 flops / prefill_s / matmul rate measured in the same run (a large matmul in the
                        model's dtype: BF16 on CUDA); flops = 2 * matmul params * T (every weight matrix
                        but the embedding and the LM head; the MTP head's only when the prefill runs it,
                        baton.handoff.policy.computes_mtp_kv: --request-engine unspecified)
                        + 2 * vocab * hidden (one LM-head row) + causal attention 4 * head_dim * heads *
                        T(T+1)/2 per full-attention layer (MTP layer included); GDN recurrences not counted

    python benchmarks/bench_ttft.py --random-init qwen3.5-9b --device cuda --prompts 512,4096,32768 --out R.json
    python benchmarks/bench_ttft.py --device cpu --prompts 16,64 --runs 5        # embedded default model
    python benchmarks/bench_ttft.py ... --decode-worker process,in-process       # both topologies
    python benchmarks/bench_ttft.py ... --sender process,thread                  # both hand-off senders
    python benchmarks/bench_ttft.py ... --tail-chunk-mib 0,1                     # without / with a 1 MiB tail
    python benchmarks/bench_ttft.py ... --no-timeline                            # A/B: the timeline's own cost

--sender: who streams the state in the prefill worker (settings.handoff_sender): "process", a sender child
process (baton/handoff/sender/process.py; the prefill's process only stages chunks into shared memory), or
"thread", gRPC's and the wire's threads in the prefill's own process; a list is measured interleaved.
--tail-chunk-mib: the wire's tail segment (settings.handoff_tail_chunk_bytes; 0 = none): the last --tail-layers
layers' state (and what follows: hidden, MTP KV) in chunks of this size, the rest in --chunk-mib chunks; a list
is measured interleaved.
Each result row has the first --decode-worker mode's, first --sender's and first --tail-chunk-mib's numbers at
its top level, every mode's (first sender, first tail) under "by_decode_worker", every sender's (first mode,
first tail) under "by_sender", every pair (first tail) under "by_decode_worker_and_sender" ("MODE/SENDER"),
every tail's (first mode, first sender) under "by_tail_chunk_mib" ("1", "0.25"), and every combination under
"by_decode_worker_sender_and_tail" ("MODE/SENDER/TAIL"). Each summary has its data_chunks.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.util
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.config import ModelConfig  # noqa: E402
from baton.handoff import timeline  # noqa: E402
from baton.handoff.policy import computes_mtp_kv, needs_mtp_kv, shipped  # noqa: E402
from baton.handoff.wire import DEFAULT_CHUNK_BYTES, FORMAT_VERSION  # noqa: E402
from baton.loading import DEFAULT_MODEL_DIR, load_model, random_model  # noqa: E402
from baton.random_init import shape  # noqa: E402
from baton.rpc import make_channel  # noqa: E402
from baton.settings import Settings  # noqa: E402
from baton.v1 import common_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from benchmarks.report import machine as base_machine
from decode_worker.serve import serve_decode  # noqa: E402
from deploy.processes import WorkerProcess, WorkerSpec  # noqa: E402
from prefill_worker.serve import serve_prefill  # noqa: E402

WIDTH = 16
MODES = ("process", "in-process")  # where the decode worker runs
SENDERS = ("process", "thread")  # who streams the hand-off in the prefill worker
REQUEST_ENGINES = {"bf16": common_pb2.BF16, "unspecified": common_pb2.ENGINE_UNSPECIFIED}
REPO = Path(__file__).resolve().parents[1]


def build_model(a) -> tuple[object, dict]:
    """-> (LoadedModel, description). --random-init: a shape name or a directory whose config.json gives
    the shape (weights seeded, not read); else --model DIR (default: the embedded default model)."""
    dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")
    if a.random_init:
        cfg = (
            ModelConfig.from_hf(a.random_init)
            if (Path(a.random_init) / "config.json").is_file()
            else shape(a.random_init)
        )
        lm = random_model(cfg, dtype=dtype, device=a.device, seed=0, mtp=not a.no_mtp)
        src = {"random_init": a.random_init}
    else:
        lm = load_model(a.model or DEFAULT_MODEL_DIR, dtype=dtype, device=a.device, mtp=False if a.no_mtp else None)
        src = {"model_dir": str(a.model or DEFAULT_MODEL_DIR)}
    return lm, src | {
        "dtype": dtype,
        "fingerprint": lm.fingerprint,
        "has_mtp": hasattr(lm.model, "mtp"),
        "params": sum(p.numel() for p in lm.model.parameters()),
        "matmul_params": matmul_params(lm.model),
    }


def matmul_params(model, mtp: bool = True) -> int:
    """Weights applied to every prompt row: matrices (and conv kernels) except the embedding and LM head
    (and the MTP head's with mtp=False)."""
    return sum(
        p.numel()
        for n, p in model.named_parameters()
        if p.dim() >= 2
        and "embed_tokens" not in n
        and not n.endswith("lm_head.weight")
        and (mtp or not n.startswith("mtp."))
    )


def prefill_flops(model, T: int, mtp: bool = True) -> int:
    """mtp: whether the prefill ran the MTP layer (baton.handoff.policy.computes_mtp_kv)."""
    cfg = model.cfg
    mtp = mtp and hasattr(model, "mtp")
    attn_layers = len(cfg.attn_layers) + int(mtp)
    attention = attn_layers * 4 * cfg.head_dim * cfg.num_attention_heads * T * (T + 1) // 2
    return 2 * matmul_params(model, mtp) * T + 2 * cfg.vocab_size * cfg.hidden_size + attention


def matmul_rate(device: str, dtype: torch.dtype, n: int, reps: int = 10) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (median of `reps` after 3 warm-ups)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for i in range(reps + 3):
        sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def machine() -> dict:
    return base_machine(fla_importable=importlib.util.find_spec("fla") is not None)


def interleaved(fns, warmup: int, runs: int) -> list[list]:
    """Each of `fns` called in turn, warmup + runs rounds (so drift on a busy host hits all alike);
    -> per fn, the results of the last `runs` rounds."""
    out = [[] for _ in fns]
    for i in range(warmup + runs):
        for f, acc in zip(fns, out):
            x = f()
            if i >= warmup:
                acc.append(x)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--random-init", default=None, help="shape name (baton/random_init.py) or a dir with config.json")
    src.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    ap.add_argument("--no-mtp", action="store_true", help="build/load the model without its MTP head")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bf16 | fp32 (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--prompts", default="512,4096,32768", help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--chunk-mib", type=float, default=DEFAULT_CHUNK_BYTES / (1 << 20), help="wire chunk size")
    ap.add_argument("--matmul-n", type=int, default=None, help="matmul size for the rate (default 8192 CUDA, 1024 CPU)")
    ap.add_argument(
        "--decode-worker",
        default="process",
        type=lambda v: v.split(","),
        help="comma-separated: process (its own process, as deployed; the default) | in-process",
    )
    ap.add_argument(
        "--decode-gpu",
        type=int,
        default=None,
        help="GPU index for the decode worker process (its CUDA_VISIBLE_DEVICES, as Ray pins an actor; "
        "default: the prefill's GPU). 1 puts it on a second GPU, as a disaggregated deployment does; "
        "on one GPU the two processes' kernels time-slice",
    )
    ap.add_argument(
        "--sender",
        default=[Settings().handoff_sender],
        type=lambda v: v.split(","),
        help="comma-separated: process (a sender child process) | thread (in the prefill's process); "
        "default: the handoff_sender setting's default",
    )
    ap.add_argument(
        "--tail-chunk-mib",
        default=[Settings().handoff_tail_chunk_bytes / (1 << 20)],
        type=lambda v: [float(x) for x in v.split(",")],
        help="comma-separated tail chunk sizes, MiB (0: no tail segment; each <= --chunk-mib); default: "
        "the handoff_tail_chunk_bytes setting's default",
    )
    ap.add_argument(
        "--tail-layers",
        type=int,
        default=Settings().handoff_tail_layers,
        help="layers the tail segment covers, counted from the last (handoff_tail_layers)",
    )
    ap.add_argument(
        "--request-engine",
        default="bf16",
        choices=sorted(REQUEST_ENGINES),
        help="PrefillRequest.engine: bf16 (what the router names for a bf16 decode worker: the MTP KV "
        "stays off the wire) | unspecified (the MTP KV is shipped: baton.handoff.policy.needs_mtp_kv)",
    )
    ap.add_argument(
        "--no-timeline",
        action="store_true",
        help="do not ask for the hand-off's timeline (PrefillRequest.timeline): no tail_ms",
    )
    ap.add_argument("--machine-note", default="")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.runs < 1 or a.warmup < 0:
        raise SystemExit("--runs must be >= 1 and --warmup >= 0")
    prompts = [int(x) for x in a.prompts.split(",")]
    modes = a.decode_worker
    if not modes or set(modes) - set(MODES) or len(set(modes)) != len(modes):
        raise SystemExit(f"--decode-worker: a comma-separated subset of {', '.join(MODES)}, got {modes}")
    if not a.sender or set(a.sender) - set(SENDERS) or len(set(a.sender)) != len(a.sender):
        raise SystemExit(f"--sender: a comma-separated subset of {', '.join(SENDERS)}, got {a.sender}")
    chunk_bytes, tails = round(a.chunk_mib * (1 << 20)), [round(x * (1 << 20)) for x in a.tail_chunk_mib]
    if len(set(tails)) != len(tails) or not all(0 <= x <= chunk_bytes for x in tails) or a.tail_layers < 0:
        raise SystemExit(
            f"--tail-chunk-mib: distinct sizes in 0..--chunk-mib ({a.chunk_mib:g}), got "
            f"{a.tail_chunk_mib}; --tail-layers >= 0, got {a.tail_layers}"
        )
    if a.decode_gpu is not None and (modes != ["process"] or not a.device.startswith("cuda")):
        raise SystemExit("--decode-gpu: only with --device cuda and --decode-worker process")
    if "process" in modes and a.no_mtp:
        raise SystemExit(
            "--no-mtp: the decode worker process always builds the MTP head; use --decode-worker in-process"
        )
    torch.manual_seed(0)
    t_setup = time.perf_counter()
    lm, model_desc = build_model(a)
    dev, cfg = a.device, lm.cfg
    p_dtype = next(lm.model.parameters()).dtype
    matmul_n = a.matmul_n or (8192 if dev.startswith("cuda") else 1024)
    rate = matmul_rate(dev, p_dtype, matmul_n)

    settings = Settings(
        token="bench-ttft",  # the auth interceptor is on, as in a deployment
        handoff_sender="process" if "process" in a.sender else "thread",
        handoff_tail_chunk_bytes=tails[0],
        handoff_tail_layers=a.tail_layers,
    )
    max_len = max(prompts) + WIDTH + 64
    # NOTE: in-process, one model object for both workers (one copy of the weights on the device); each
    # has its own state. The decode process builds its own copy.
    ph, ps = serve_prefill(
        lm, device=dev, width=WIDTH, max_len=max_len, slots=1, settings=settings, chunk_bytes=chunk_bytes
    )
    targets, stops = {}, [lambda: ph.stop(0)]
    try:
        for mode in modes:
            if mode == "in-process":
                dh, _ = serve_decode(
                    lm, engines=("bf16",), device=dev, width=WIDTH, max_len=max_len, slots=1, settings=settings
                )
                stops.append(lambda dh=dh: dh.stop(0))
            else:
                dh = decode_process(a, max_len, settings.token)
                stops.append(dh.stop)
            targets[mode] = dh.address
        setup_s = time.perf_counter() - t_setup
        g = torch.Generator().manual_seed(1)
        rows = []
        with make_channel(ph.address, settings) as pch, contextlib.ExitStack() as chans:
            P = prefill_pb2_grpc.PrefillWorkerStub(pch)
            D = {
                m: decode_pb2_grpc.DecodeWorkerStub(chans.enter_context(make_channel(addr, settings)))
                for m, addr in targets.items()
            }
            for T in prompts:
                ids = torch.randint(0, cfg.vocab_size, (T,), generator=g).tolist()
                rows.append(measure(a, ps, P, D, targets, ids, rate))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        for stop in reversed(stops):
            stop()
    result = {
        "benchmark": "ttft",
        "command": shlex.join(["python", "benchmarks/bench_ttft.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine() | ({"note": a.machine_note} if a.machine_note else {}),
        "torch": torch.__version__,
        "device": dev,
        "decode_gpu": a.decode_gpu,
        "model": model_desc,
        "setup_seconds": round(setup_s, 2),
        "workers": {
            "width": WIDTH,
            "max_len": max_len,
            "decode_engine": "bf16",
            "request_engine": a.request_engine,
            "wire_format": FORMAT_VERSION,
            "chunk_bytes": ps.chunk_bytes,
            "transport": "loopback gRPC, bearer token, no TLS",
            "decode_worker": modes,
            "handoff_sender": a.sender,
            "tail_chunk_mib": a.tail_chunk_mib,
            "tail_layers": a.tail_layers,
            "timeline": not a.no_timeline,
            "timeline_clock": timeline.CLOCK_ID,
        },
        "matmul": {"dtype": str(p_dtype).replace("torch.", ""), "n": matmul_n, "tflops": round(rate / 1e12, 4)},
        "runs": a.runs,
        "warmup": a.warmup,
        "results": rows,
    }
    emit(result, a.out)
    return result


def worker_process(a, role: str, max_len: int, token: str, extra: list, device: str, gpu=None, **spec) -> WorkerProcess:
    """`python -m {role}_worker` on a free port with this benchmark's model (the same --random-init shape and
    seed 0, or the same checkpoint: the same fingerprint), serving once health says so. extra: more
    (option, value) pairs; gpu: its CUDA_VISIBLE_DEVICES; spec: more WorkerSpec fields."""
    extra = [("width", WIDTH), *extra] + ([("random_init", a.random_init), ("seed", 0)] if a.random_init else [])
    spec = WorkerSpec(
        role,
        0,
        model_dir=str(a.model) if a.model else None,
        device=device,
        dtype=a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32"),
        max_len=max_len,
        grace=0.0,
        extra=tuple((k, str(v)) for k, v in extra),
        **spec,
    )
    env = dict(
        os.environ,
        BATON_TOKEN=token,
        PYTHONPATH=os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
    )
    env.pop("BATON_TOKEN_FILE", None)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    if not spec.device.startswith("cuda"):  # as many torch threads as this process uses
        env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    w = WorkerProcess(spec, env=env).start()
    try:
        w.wait_ready(timeout=900, settings=Settings(token=token))
    except BaseException:
        w.stop()
        raise
    return w


def decode_process(a, max_len: int, token: str, slots: int = 1) -> WorkerProcess:
    """The benchmark's bf16 decode worker process (worker_process)."""
    device = getattr(a, "decode_device", None) or a.device  # bench_ttft_burst --decode-device
    extra = [("slots", slots), ("engines", "bf16")]
    return worker_process(a, "decode", max_len, token, extra, device, gpu=a.decode_gpu, engine="bf16")


def measure(a, ps, P, D: dict, targets: dict, ids: list[int], rate: float) -> dict:
    dev, eng, T = a.device, ps.engine, len(ids)
    req_engine = REQUEST_ENGINES[a.request_engine]
    mtp = computes_mtp_kv(False, req_engine, True)  # whether split()'s FAST Prefill runs the MTP layer
    state_bytes = []  # what the hand-off ships

    def prefill_only() -> float:
        sync(dev)
        t0 = time.perf_counter()
        s, _ = eng.prefill(ids, mtp=mtp)
        sync(dev)
        dt = time.perf_counter() - t0
        try:
            if not state_bytes:
                tensors, pos, _ = eng.export(s.id)
                assert pos == T
                state_bytes.append(
                    sum(t.tensor.numel() * t.tensor.element_size() for t in shipped(tensors, needs_mtp_kv(req_engine)))
                )
        finally:
            eng.release(s.id)
        return dt

    process_sender = ps.sender  # the prefill worker's SenderProcess (None when only "thread" is measured)

    def split(mode: str, sender: str, tail: float) -> tuple[float, float, common_pb2.BridgeReport]:
        sid = f"ttft-{T}"
        ps.sender = process_sender if sender == "process" else None  # NOTE: between requests only
        ps.tail_chunk_bytes = round(tail * (1 << 20))
        sync(dev)
        t0 = time.perf_counter()
        r = P.Prefill(
            prefill_pb2.PrefillRequest(
                session_id=sid,
                prompt_ids=ids,
                mode=common_pb2.FAST,
                decode_target=targets[mode],
                timeline=not a.no_timeline,
                engine=req_engine,
            ),
            timeout=600,
        )
        t_reply = time.monotonic_ns()
        sync(dev)
        dt = time.perf_counter() - t0
        if r.bridge.HasField("timeline"):
            r.bridge.timeline.marks_ns["client.reply"] = t_reply
            r.bridge.timeline.clocks["client"] = timeline.CLOCK_ID
        assert D[mode].Release(common_pb2.ReleaseRequest(session_id=sid), timeout=60).released
        return dt, r.prefill_seconds, r.bridge

    modes, senders, tails = list(targets), a.sender, a.tail_chunk_mib
    combos = [(m, w, x) for m in modes for w in senders for x in tails]
    pre, *spls = interleaved([prefill_only] + [functools.partial(split, *c) for c in combos], a.warmup, a.runs)
    ps.sender, ps.tail_chunk_bytes = process_sender, round(tails[0] * (1 << 20))
    nbytes = state_bytes[0]
    prefill_s = statistics.median(pre)
    by_all = {f"{m}/{w}/{x:g}": split_summary(spl, nbytes, prefill_s) for (m, w, x), spl in zip(combos, spls)}
    for key, summary in by_all.items():
        print_tail(T, key, summary)
    t0 = f"{tails[0]:g}"
    by_pair = {f"{m}/{w}": by_all[f"{m}/{w}/{t0}"] for m in modes for w in senders}
    by_mode = {m: by_pair[f"{m}/{senders[0]}"] for m in modes}
    by_sender = {w: by_pair[f"{modes[0]}/{w}"] for w in senders}
    by_tail = {f"{x:g}": by_all[f"{modes[0]}/{senders[0]}/{x:g}"] for x in tails}
    spl = spls[0]
    flops = prefill_flops(eng.runner.model, T, mtp=mtp)
    return {
        "prompt_tokens": T,
        "prefill_s": round(prefill_s, 6),
        "decode_worker": modes[0],
        "sender": senders[0],
        "tail_chunk_mib": tails[0],
        **by_mode[modes[0]],
        "state_bytes": nbytes,
        "state_bytes_by_kind": dict(spl[0][2].bytes_by_kind),
        "data_chunks": spl[0][2].chunks,
        "flops": flops,
        "achieved_tflops": round(flops / prefill_s / 1e12, 4),
        "mfu": round(flops / prefill_s / rate, 4),
        "prefill_s_runs": [round(x, 6) for x in pre],
        "by_decode_worker": by_mode,
        "by_sender": by_sender,
        "by_decode_worker_and_sender": by_pair,
        "by_tail_chunk_mib": by_tail,
        "by_decode_worker_sender_and_tail": by_all,
    }


def split_summary(spl: list, nbytes: int, prefill_s: float) -> dict:
    """spl: (split seconds, server prefill seconds, BridgeReport) per run, for one decode-worker mode."""
    if any(b.total_bytes != nbytes for _, _, b in spl):
        raise AssertionError(f"bridge total_bytes {[b.total_bytes for _, _, b in spl]} != state bytes {nbytes}")
    split_s = statistics.median(s for s, _, _ in spl)
    handoff_s = statistics.median(b.seconds for _, _, b in spl)
    return {
        "split_s": round(split_s, 6),
        "split_overhead_pct": round(100 * (split_s / prefill_s - 1), 2),
        "handoff_s": round(handoff_s, 6),
        "handoff_GBps": round(nbytes / handoff_s / 1e9, 3),
        "handoff_wall_s": round(statistics.median(s - p for s, p, _ in spl), 6),
        "server_prefill_s": round(statistics.median(p for _, p, _ in spl), 6),
        "data_chunks": spl[0][2].chunks,
        "split_s_runs": [round(s, 6) for s, _, _ in spl],
        "handoff_s_runs": [round(b.seconds, 6) for _, _, b in spl],
    } | tail_summary([b for _, _, b in spl])


def tail_summary(bridges: list) -> dict:
    """The hand-off's timeline over runs (empty without one): tail_ms (mark -> median ms after
    prefill.compute_end over the runs, marks present in every run, ordered by it), tail_ms_runs (each run's),
    tail_backlog (per chunk series: median data chunks not yet past that stage at prefill.compute_end),
    tail_clock_shared (every process read one clock; if not, tail_ms has the marks on the prefill's only),
    tail_ordered (no run breaks an order causality imposes: baton.handoff.timeline.violations)."""
    tls = [b.timeline for b in bridges if b.HasField("timeline")]
    if not tls or len(tls) != len(bridges):
        return {}
    offs = [timeline.offsets_ms(t) for t in tls]
    names = set(offs[0]).intersection(*offs[1:])
    med = {k: statistics.median(o[k] for o in offs) for k in names}
    order = sorted(names, key=lambda k: (med[k], k))
    behind = [timeline.behind_at(t) for t in tls]
    series = set(behind[0]).intersection(*behind[1:])
    return {
        "tail_ms": {k: round(med[k], 3) for k in order},
        "tail_ms_runs": {k: [round(o[k], 3) for o in offs] for k in order},
        "tail_backlog": {k: statistics.median(b[k] for b in behind) for k in sorted(series)},
        "tail_clock_shared": all(timeline.shared_clock(t) for t in tls),
        "tail_ordered": not any(timeline.violations(t) for t in tls),
    }


def print_tail(T: int, key: str, summary: dict) -> None:
    """The tail breakdown of one combination, on stderr: each mark's median ms after prefill.compute_end
    and the step from the mark before it."""
    tail = summary.get("tail_ms")
    if not tail:
        return
    runs = len(next(iter(summary["tail_ms_runs"].values())))
    lines = [
        f"tail T={T} {key}: ms after prefill.compute_end (median of {runs}; split_s "
        f"{summary['split_s'] * 1e3:.1f} ms, server_prefill_s {summary['server_prefill_s'] * 1e3:.1f} ms"
        f"{'' if summary['tail_clock_shared'] else '; clocks NOT shared: prefill-side marks only'}"
        f"{'' if summary['tail_ordered'] else '; CAUSALITY VIOLATED in a run: see baton.handoff.timeline.violations'})"
    ]
    prev = None
    for k, v in tail.items():
        rs = summary["tail_ms_runs"][k]
        step = "" if prev is None else f"{v - prev:+9.3f}"
        lines.append(f"  {v:10.3f} {step:>9}  {k:<30} runs {min(rs):.3f}..{max(rs):.3f}")
        prev = v
    backlog = summary.get("tail_backlog") or {}
    if backlog:
        lines.append(
            f"  chunks not yet past each stage at prefill.compute_end (of {summary['data_chunks']}): "
            + ", ".join(f"{k} {v:g}" for k, v in backlog.items())
        )
    print("\n".join(lines), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
