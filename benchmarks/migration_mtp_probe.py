"""MTP draft acceptance after an exact session migrates (ExportState), against a session whose MTP KV
covers every position. CPU, the embedded (trained) default model, in-process workers over loopback gRPC.

    python benchmarks/migration_mtp_probe.py [--generated 64] [--new 64] [--prompts 4] [--out FILE]

The prefill worker's Verify runs the main model only, so an EXACT session's MTP-layer KV covers its
prompt and not the tokens verified after it; ExportState ships those rows as they are (zeros from the
slot reset), and the decode worker's MTP drafts then attend to them. For each prompt:
    control    FAST Prefill of prompt + the first G exact tokens (MTP KV everywhere), then MTP Decode
    migrated   EXACT Prefill of the prompt, Verify blocks of the exact tokens past G, ExportState to the
               decode worker, then MTP Decode to the same end
Reports DecodeResponse.mean_accept_len (tokens per MTP round) for both; both outputs must equal the
exact greedy tokens (exactness does not depend on the MTP KV). Prints JSON.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from baton.complete import complete  # noqa: E402
from baton.loading import DEFAULT_MODEL_DIR, load_model  # noqa: E402
from baton.rpc import make_channel  # noqa: E402
from baton.settings import Settings  # noqa: E402
from baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from decode_worker.serve import serve_decode  # noqa: E402
from prefill_worker.serve import serve_prefill  # noqa: E402

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\ndef main(",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):\n",
]
MAX_LEN, WIDTH, BLOCK = 1024, 16, 8
MTP, FAST, EXACT = common_pb2.MTP, common_pb2.FAST, common_pb2.EXACT


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generated", type=int, default=64, help="exact tokens before the migration (G)")
    ap.add_argument("--new", type=int, default=64, help="tokens decoded after it")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    from tokenizers import Tokenizer

    lm = load_model(DEFAULT_MODEL_DIR, dtype="fp32")
    tok = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    st = Settings()
    ph, _ = serve_prefill(lm, max_len=MAX_LEN, width=WIDTH, slots=2, settings=st)
    dh, _ = serve_decode(
        load_model(DEFAULT_MODEL_DIR, dtype="fp32"),
        engines=("bf16", "mtp"),
        max_len=MAX_LEN,
        width=WIDTH,
        slots=2,
        settings=st,
    )
    pc, dc = make_channel(ph.address, st), make_channel(dh.address, st)
    P, D = prefill_pb2_grpc.PrefillWorkerStub(pc), decode_pb2_grpc.DecodeWorkerStub(dc)

    def decode(sid: str, n: int) -> tuple[list[int], float]:
        out, last = [], None
        for m in D.Decode(
            decode_pb2.DecodeRequest(
                session_id=sid, max_new_tokens=n, ignore_eos=True, engine=MTP, release_at_end=True
            ),
            timeout=300,
        ):
            out += m.token_ids
            last = m
        return out, last.mean_accept_len

    rows = []
    try:
        for k, text in enumerate(PROMPTS[: a.prompts]):
            ids = tok.encode(text).ids
            total = a.generated + a.new
            ref = complete(None, ids, total, max_len=MAX_LEN, width=WIDTH, loaded=lm, ignore_eos=True)
            # migrated: exact session, Verify the exact tokens in blocks until >= G are committed
            r = P.Prefill(
                prefill_pb2.PrefillRequest(session_id=f"m{k}", prompt_ids=ids, mode=EXACT, engine=MTP), timeout=300
            )
            out = [r.first_token]
            while len(out) < a.generated:
                blk = ref[len(out) : len(out) + BLOCK]
                v = P.Verify(prefill_pb2.VerifyRequest(session_id=f"m{k}", tokens=[out[-1]] + blk), timeout=300)
                out += blk[: v.accepted] + [v.next_token]
            P.ExportState(
                prefill_pb2.ExportStateRequest(
                    session_id=f"m{k}", decode_target=dh.address, target_session_id=f"m2{k}"
                ),
                timeout=300,
            )
            P.Release(common_pb2.ReleaseRequest(session_id=f"m{k}"), timeout=60)
            out_m, acc_m = decode(f"m2{k}", total - len(out))
            # control: the same committed tokens prefilled FAST, so the MTP KV covers all of them
            g = len(out) - 1  # tokens past the prompt whose KV the prefill writes
            r = P.Prefill(
                prefill_pb2.PrefillRequest(
                    session_id=f"c{k}", prompt_ids=ids + out[:g], mode=FAST, engine=MTP, decode_target=dh.address
                ),
                timeout=300,
            )
            out_c, acc_c = decode(f"c{k}", total - len(out))
            rows.append(
                {
                    "prompt_tokens": len(ids),
                    "migrated_at": len(out),
                    "decoded": len(out_m),
                    "mean_accept_len_control": round(acc_c, 3),
                    "mean_accept_len_migrated": round(acc_m, 3),
                    "exact_control": [r.first_token] + out_c == ref[g:],
                    "exact_migrated": out + out_m == ref,
                }
            )
    finally:
        pc.close()
        dc.close()
        ph.stop(0)
        dh.stop(0)
    mean = {
        k: round(sum(r[k] for r in rows) / len(rows), 3)
        for k in ("mean_accept_len_control", "mean_accept_len_migrated")
    }
    res = {
        "benchmark": "migration_mtp_probe",
        "command": " ".join(["python", "benchmarks/migration_mtp_probe.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": "embedded default model (trained tiny), fp32, CPU",
        "torch": torch.__version__,
        "block": BLOCK,
        "results": rows,
        "mean": mean,
    }
    emit(res, a.out)
    return res


if __name__ == "__main__":
    main()
