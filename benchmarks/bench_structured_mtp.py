"""Fast mtp under a grammar against fast bf16 and unconstrained mtp (decode_worker/mtp.py _round: a masked
session's drafts follow its grammar, BATON_MTP_MASKED_DRAFTS=0 for unconstrained ones, and its verify rows are
masked by it): tokens per MTP round and decode tok/s, the embedded default model over loopback gRPC in this
process.

    python benchmarks/bench_structured_mtp.py [--device cpu] [--new 64] [--mtp-draft-length fixed --mtp-k 3]
                                              [--mixed-runs N] [--no-exact] [--out FILE]

Per (grammar, engine): the tokens of each request (checked: mtp equals bf16, token for token), decode tok/s
(tokens after the first / the time after the first message), and for mtp the tokens per round (the decode
worker's WorkerStats.mtp_rounds_by_k over the run: one request at a time, so its rounds are the session's).
Tokens per round is the figure that carries to the GPU (absolute times hold only there).

Mixed (--mixed-runs N, default 2): a plain request and a json_object request on fast mtp at once, for each
prompt, alternately with each session's own draft cap (baton/engine/draft_cap.py) and without it
(BATON_MTP_OWN_CAPS=0): each request's tokens a round (Stats.mean_accept_len) and tok/s, its tokens checked
against the same request alone. One controller serves both sessions, so without own caps the grammar's
rejected drafts may lower the K of the plain one (on the CPU no difference beyond noise: docs/PERFORMANCE.md).

Exact (--exact, default on): each grammar in exact mode with mtp drafts, its drafts masked by the grammar on
the decode worker (decode_worker/drafting.py) and unconstrained (BATON_MTP_MASKED_DRAFTS=0): drafts kept of
drafted, tokens a round (Stats: tokens / rounds) and decode tok/s, the tokens checked against fast bf16's.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.report import emit, header  # noqa: E402

PROMPTS = ["def sub_debug(msg, *args):\n    if _logger:\n", "Describe a user as JSON:", "class Config:\n"]
GRAMMARS = {
    "none": None,
    "python_line": {"regex": "[^\\n]{1,160}\\n[^\\n]{1,160}\\n[^\\n]{1,160}\\n"},  # three lines: little binding
    "json_object": {"json_object": True},  # binding: a code model writes no JSON of its own
}


def _rounds(engine, common_pb2) -> int:
    """The decode worker's MTP rounds so far (WorkerStats.mtp_rounds_by_k: every K, 0 included)."""
    out = common_pb2.WorkerStats()
    engine.fill_step_stats(out)
    return sum(out.mtp_rounds_by_k.values())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="the workers' device (cpu, cuda)")
    ap.add_argument("--new", type=int, default=64, help="new tokens a request")
    ap.add_argument("--mixed-runs", type=int, default=2, help="mixed runs with own caps on, then off, each (0: none)")
    ap.add_argument(
        "--mtp-draft-length",
        default="adaptive",
        choices=("adaptive", "fixed"),
        help="the decode worker's K policy (fixed: --mtp-k every round, so tokens a round measure the acceptance)",
    )
    ap.add_argument("--mtp-k", type=int, default=3, help="the decode worker's K (fixed) or the adaptive prior")
    ap.add_argument(
        "--exact", action=argparse.BooleanOptionalAction, default=True, help="exact mode, masked drafts and not"
    )
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)

    from baton.loading import load_model
    from baton.v1 import common_pb2

    lm = load_model(None, dtype="fp32" if args.device == "cpu" else "bf16", device=args.device, mtp=True)
    rows, alone = [], {}
    with _stack(lm, args) as (c, engine):
        for name, spec in GRAMMARS.items():
            got: dict = {}
            for eng in ("bf16", "mtp"):
                toks, decode_s, rounds = [], 0.0, 0
                for prompt in PROMPTS:
                    before = _rounds(engine, common_pb2)
                    t_first, ids = None, []
                    kw = {"structured": spec} if spec else {}
                    for d in c.generate(prompt, max_new_tokens=args.new, timeout=600, engine=eng, **kw):
                        if t_first is None:
                            t_first = time.perf_counter()
                        ids += d.token_ids
                    decode_s += time.perf_counter() - t_first
                    rounds += _rounds(engine, common_pb2) - before
                    toks.append(ids)
                got[eng] = toks
                row = {"grammar": name, "engine": eng, "tokens": sum(map(len, toks))}
                row["decode_tok_s"] = round(sum(len(t) - 1 for t in toks) / decode_s, 2)
                if eng == "mtp":
                    row["tokens_per_round"] = round(sum(len(t) - 1 for t in toks) / max(rounds, 1), 3)
                    row["equals_bf16"] = toks == got["bf16"]
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
            alone[name] = got["mtp"]
        exact = _exact(c, args, alone) if args.exact else []
    mixed = _mixed(lm, args, alone) if args.mixed_runs else []
    res = header(__file__, argv) | {
        "device": args.device,
        "new_tokens": args.new,
        "mtp_draft_length": args.mtp_draft_length,
        "mtp_k": args.mtp_k,
        "prompts": PROMPTS,
        "grammars": GRAMMARS,
        "results": rows,
        "mixed": mixed,
        "exact": exact,
    }
    emit(res, args.out)
    return res


@contextlib.contextmanager
def _stack(lm, args):
    """A prefill worker, a decode worker (bf16, mtp) and a router over loopback gRPC -> (client, decode engine)."""
    from baton.client import Client
    from baton.settings import Settings
    from decode_worker.serve import serve_decode
    from prefill_worker.serve import serve_prefill
    from router.__main__ import serve_router, stop_router

    st, device = Settings(), args.device
    ph, _ = serve_prefill(lm, device=device, max_len=512, settings=st)
    dh, _ = serve_decode(
        lm,
        engines=("bf16", "mtp"),
        device=device,
        max_len=512,
        settings=st,
        mtp_k=args.mtp_k,
        mtp_draft_length=args.mtp_draft_length,
    )
    rh, rs = serve_router(prefill=[ph.address], decode=[dh.address], settings=st)
    c = Client(rh.address)
    try:
        for _ in range(50):  # serving
            if c.health() == "SERVING":
                break
            time.sleep(0.2)
        yield c, dh.servicer.engine
    finally:
        c.close()
        stop_router(rh, rs, 0)
        ph.stop(0)
        dh.stop(0)


def _mixed(lm, args, alone: dict) -> list[dict]:
    """The mixed runs (module doc), each mode on fresh workers (the worker's controller learns from every
    request it served): per mode and run, each kind's mean tokens a round and tok/s over the prompts."""
    from decode_worker.mtp import OWN_CAPS_ENV

    kinds = {"plain": None, "json_object": GRAMMARS["json_object"]}
    out = []
    for run in range(args.mixed_runs):
        for mode in ("on", "off"):
            os.environ[OWN_CAPS_ENV] = "1" if mode == "on" else "0"
            per = {k: {"accept": [], "tok_s": [], "equal": True} for k in kinds}
            with _stack(lm, args) as (c, _):
                _pairs(c, args, alone, kinds, per)
            row = {"run": run, "own_caps": mode}
            for kind, v in per.items():
                row[kind] = {
                    "tokens_per_round": round(statistics.mean(v["accept"]), 3),
                    "tok_s": round(statistics.mean(v["tok_s"]), 2),
                    "equals_alone": v["equal"],
                }
            out.append(row)
            print(json.dumps(row), file=sys.stderr)
    os.environ.pop(OWN_CAPS_ENV, None)
    return out


def _exact(c, args, alone: dict) -> list[dict]:
    """Exact mode (mtp drafts) per grammar, drafts masked ("1") and unconstrained ("0"): one row each."""
    from decode_worker.mtp import MASKED_DRAFTS_ENV

    out = []
    for name, spec in GRAMMARS.items():
        for masked in ("1", "0") if spec else ("1",):
            os.environ[MASKED_DRAFTS_ENV] = masked
            toks, decode_s, drafted, kept, rounds = [], 0.0, 0, 0, 0
            for prompt in PROMPTS:
                kw = {"structured": spec} if spec else {}
                t_first, ids, last = None, [], None
                for d in c.generate(prompt, max_new_tokens=args.new, timeout=600, mode="exact", engine="mtp", **kw):
                    t_first = t_first or time.perf_counter()
                    ids, last = ids + d.token_ids, d
                decode_s += time.perf_counter() - t_first
                toks.append(ids)
                drafted, kept = drafted + last.stats["drafted"], kept + last.stats["accepted"]
                rounds += last.stats["rounds"]
            row = {"grammar": name, "masked_drafts": masked == "1", "drafted": drafted, "accepted": kept}
            row["acceptance"] = round(kept / max(drafted, 1), 3)
            row["tokens_per_round"] = round(sum(len(t) - 1 for t in toks) / max(rounds, 1), 3)
            row["decode_tok_s"] = round(sum(len(t) - 1 for t in toks) / decode_s, 2)
            row["equals_bf16"] = toks == alone[name]
            out.append(row)
            print(json.dumps(row), file=sys.stderr)
    os.environ.pop(MASKED_DRAFTS_ENV, None)
    return out


def _pairs(c, args, alone: dict, kinds: dict, per: dict) -> None:
    """For each prompt, one request of each kind at once on fast mtp; their figures appended to `per`."""
    for i, prompt in enumerate(PROMPTS):
        res: dict = {}

        def one(kind, spec, prompt=prompt, res=res):
            kw = {"structured": spec} if spec else {}
            t_first, ids, last = None, [], None
            for d in c.generate(prompt, max_new_tokens=args.new, timeout=600, engine="mtp", **kw):
                t_first = t_first or time.perf_counter()
                ids, last = ids + d.token_ids, d
            res[kind] = (ids, (len(ids) - 1) / (time.perf_counter() - t_first), last.stats["mean_accept_len"])

        ts = [threading.Thread(target=one, args=kv) for kv in kinds.items()]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for kind in kinds:
            ids, tok_s, acc = res[kind]
            per[kind]["equal"] &= ids == alone["none" if kind == "plain" else kind][i]
            per[kind]["accept"].append(acc)
            per[kind]["tok_s"].append(tok_s)


if __name__ == "__main__":
    main()
