"""Exact mode at T > 0, the two policies side by side (issue 22, rule 3): mean accepted tokens per round of
COUPLING (accept a draft iff it equals the exact model's seeded pick) and REJECTION (speculative rejection
sampling) on the embedded default model, CPU fp32, over real loopback gRPC: a prefill worker and a decode
worker in this process, driven Draft -> Verify -> Draft(verdict) as router/exact.py does.

    OMP_NUM_THREADS=2 python benchmarks/exact_policy_acceptance.py [--prompts 6] [--seeds 2] [--new 64] [--k 4]

Prompts: held-out stdlib prompts (benchmarks/acceptance_default_model.py: heldout_prompts, 48 tokens each).
Per (drafting engine fp8 / mtp, T 0.7 / 1.0, policy): tokens per round = sum (m + 1) / rounds (the
correction or bonus token included), drafts accepted = sum m / sum k, and the wire: mean DraftResponse and
VerifyRequest bytes per round, and the proposal support sizes (REJECTION ships q' per draft; COUPLING
nothing). A round stops at EOS or after --new tokens. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "deploy"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def run_one(pstub, dstub, sid, ids, engine, sp, k, new, eos):
    from baton.v1 import common_pb2, decode_pb2, prefill_pb2

    eng = {"fp8": common_pb2.FP8, "mtp": common_pb2.MTP}[engine]
    r = pstub.Prefill(
        prefill_pb2.PrefillRequest(
            session_id=sid, prompt_ids=ids, mode=common_pb2.EXACT, decode_target=dstub.address, engine=eng, sampling=sp
        ),
        timeout=120,
    )
    out, pending, verdict, rounds = [r.first_token], r.first_token, None, []
    try:
        while len(out) < new and out[-1] not in eos:
            kk = max(1, min(k, new - len(out) - 1))
            req = decode_pb2.DraftRequest(
                session_id=sid, k=kk, engine=eng, has_verdict=verdict is not None, sampling=sp
            )
            if verdict is not None:
                req.accepted, req.next_token = verdict
            d = dstub.stub.Draft(req, timeout=120)
            vreq = prefill_pb2.VerifyRequest(
                session_id=sid, tokens=[pending, *d.draft_tokens], draft_probs=d.draft_probs
            )
            v = pstub.Verify(vreq, timeout=120)
            m = int(v.accepted)
            rounds.append(
                dict(
                    k=kk,
                    m=m,
                    draft_bytes=d.ByteSize(),
                    verify_bytes=vreq.ByteSize(),
                    support=[len(q.token_ids) for q in d.draft_probs],
                    # a check that q' is the distribution each draft was drawn from: E[q'(d)] = sum q'^2
                    q_of_draft=[q.probs[list(q.token_ids).index(x)] for q, x in zip(d.draft_probs, d.draft_tokens)],
                    sum_q_sq=[sum(v * v for v in q.probs) for q in d.draft_probs],
                )
            )
            out += list(d.draft_tokens[:m]) + [int(v.next_token)]
            pending, verdict = int(v.next_token), (m, int(v.next_token))
    finally:
        pstub.Release(common_pb2.ReleaseRequest(session_id=sid), timeout=30)
        dstub.stub.Release(common_pb2.ReleaseRequest(session_id=sid), timeout=30)
    return out, rounds


class _Decode:
    def __init__(self, address, channel):
        from baton.v1 import decode_pb2_grpc

        self.address, self.stub = address, decode_pb2_grpc.DecodeWorkerStub(channel)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--engines", default="fp8,mtp")
    args = ap.parse_args(argv)

    from acceptance_default_model import heldout_prompts

    from baton.loading import load_model, resolve_model_dir
    from baton.rpc import make_channel
    from baton.settings import Settings
    from baton.tokenizer import Tokenizer
    from baton.v1 import common_pb2, prefill_pb2_grpc
    from decode_worker.serve import serve_decode
    from prefill_worker.serve import serve_prefill

    t_start = time.time()
    lm = load_model(None, dtype="fp32", device="cpu", mtp=True)
    tok = Tokenizer.from_dir(resolve_model_dir(None))
    eos = set(tok.eos_token_ids)
    prompts = heldout_prompts(tok, 48, args.prompts)
    st, max_len = Settings(), 48 + args.new + 32
    ph, _ = serve_prefill(lm, max_len=max_len, settings=st)
    dh, _ = serve_decode(lm, max_len=max_len, settings=st, default_engine="fp8")
    results = {}
    with make_channel(ph.address, st) as pc, make_channel(dh.address, st) as dc:
        pstub, dstub = prefill_pb2_grpc.PrefillWorkerStub(pc), _Decode(dh.address, dc)
        n = 0
        for engine in args.engines.split(","):
            for T in (float(t) for t in args.temperatures.split(",")):
                for policy, value in (("coupling", common_pb2.COUPLING), ("rejection", common_pb2.REJECTION)):
                    rounds, per_req, lens, t0 = [], [], [], time.perf_counter()
                    for i, p in enumerate(prompts):
                        for s in range(args.seeds):
                            sp = common_pb2.SamplingParams(temperature=T, seed=1000 * s + i, exact_policy=value)
                            n += 1
                            out, rs = run_one(pstub, dstub, f"r{n}", p["ids"], engine, sp, args.k, args.new, eos)
                            rounds += rs
                            lens.append(len(out))
                            per_req.append(round(sum(r["m"] + 1 for r in rs) / max(1, len(rs)), 3))
                    secs = time.perf_counter() - t0
                    sup = [x for r in rounds for x in r["support"]]
                    results[f"{engine}/T{T}/{policy}"] = {
                        "rounds": len(rounds),
                        "tokens": sum(lens),
                        "mean_tokens_per_round": round(sum(r["m"] + 1 for r in rounds) / len(rounds), 3),
                        "mean_tokens_per_round_full_k_rounds": round(
                            statistics.mean(r["m"] + 1 for r in rounds if r["k"] == args.k), 3
                        ),
                        "tokens_per_s_after_prefill_incl": round(sum(lens) / secs, 2),
                        "draft_acceptance": round(sum(r["m"] for r in rounds) / sum(r["k"] for r in rounds), 3),
                        "per_request_tokens_per_round": per_req,
                        "mean_draft_response_bytes": round(statistics.mean(r["draft_bytes"] for r in rounds), 1),
                        "mean_verify_request_bytes": round(statistics.mean(r["verify_bytes"] for r in rounds), 1),
                        "proposal_check_mean_q_of_draft_vs_mean_sum_q_sq": [
                            round(statistics.mean(x for r in rounds for x in r["q_of_draft"]), 4) if sup else None,
                            round(statistics.mean(x for r in rounds for x in r["sum_q_sq"]), 4) if sup else None,
                        ],
                        "proposal_support": (
                            {"mean": round(statistics.mean(sup), 1), "max": max(sup), "min": min(sup)} if sup else None
                        ),
                    }
                    print(f"{engine}/T{T}/{policy}: {results[f'{engine}/T{T}/{policy}']}", file=sys.stderr, flush=True)
    ph.stop(0)
    dh.stop(0)
    vocab = lm.cfg.vocab_size
    print(
        json.dumps(
            {
                "command": "OMP_NUM_THREADS="
                + os.environ.get("OMP_NUM_THREADS", "")
                + " python "
                + " ".join(shlex.quote(a) for a in ["benchmarks/exact_policy_acceptance.py", *(argv or sys.argv[1:])]),
                "machine": f"{platform.machine()} {os.cpu_count()}-core CPU, {platform.platform()}",
                "date": datetime.date.today().isoformat(),
                "seconds": round(time.time() - t_start, 1),
                "model": "embedded default model (baton/assets/default-model), fp32 CPU",
                "setup": f"{len(prompts)} held-out prompts x {args.seeds} seeds, {args.new} new tokens, K = {args.k}",
                "vocab": vocab,
                "dense_q_bytes_per_draft": 4 * vocab,
                "results": results,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
