"""Speculation acceptance of the embedded default model on held-out stdlib prompts (CPU, fp32 by default).

    python benchmarks/acceptance_default_model.py [--model DIR] [--new 128] [--prompt-tokens 48] [--k-mtp 3] [--k-fp8 4]
    python benchmarks/acceptance_default_model.py --device cuda --dtype bf16 --no-hf     # on the GPU (batched rounds
                                                                                         # as the decode worker's)

Prompts: the first `--prompt-tokens` tokens from the first `def` of held-out files (deploy/default_model_corpus.py:
sha256(relpath) mod 20 == 0) of this interpreter's stdlib, skipping the `test` packages. The split is by
path, so every such file is held out from training whatever Python version trained the model.

Measured, per prompt and in total (greedy, stop at EOS or after --new tokens):
  * reference: ExactEngine.generate (prefill + fixed-width AR rows, what `baton complete` prints);
  * bf16 and mtp engines of a DecodeEngine over one ModelRunner of the model loaded with its MTP head,
    each session loaded from an ExactEngine prefill + export (the in-process LoadState handoff);
    mtp: acceptance length per round (m + 1, the bonus token included) at K = --k-mtp;
  * batched mtp (unless --no-batched): every prompt's mtp decode at once on one DecodeEngine, so rounds
    of several sessions verify in one pass: the acceptance per round, and whether each session's tokens
    and rounds equal its run alone;
  * exact mode with FP8 drafts: DecodeEngine("fp8") over a deep copy quantized with
    quantize_model(copy, "full"), Draft -> ExactEngine.verify -> Draft(verdict) ... at K = --k-fp8;
  * every path's tokens are checked against the reference (they must be identical);
  * HF parity: Baton's vs transformers' Qwen3_5ForCausalLM full-prompt logits on one prompt (fp32).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import shlex
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "deploy"))

import default_model_corpus  # noqa: E402

from baton.engine.runner import ModelRunner  # noqa: E402
from baton.loading import load_model, resolve_model_dir  # noqa: E402
from baton.tokenizer import Tokenizer  # noqa: E402
from decode_worker.engine import DecodeEngine  # noqa: E402
from decode_worker.fp8 import quantize_model  # noqa: E402
from prefill_worker.engine import ExactEngine  # noqa: E402

SKIP_PREFIXES = (
    "test/",
    "idlelib/idle_test/",
    "lib2to3/tests/",
    "distutils/tests/",
    "tkinter/test/",
    "unittest/test/",
    "encodings/",
)  # encodings/*: code tables, not code


def heldout_prompts(tok: Tokenizer, n_tokens: int, count: int) -> list[dict]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for rel, path in default_model_corpus.stdlib_files(root):
        if default_model_corpus.split_of(rel) != "test" or rel.startswith(SKIP_PREFIXES):
            continue
        try:
            text = path.read_text("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        cuts = [i for i in (text.find("\ndef "), text.find("\n    def ")) if i >= 0]
        if not cuts:
            continue
        ids = tok.encode(text[min(cuts) + 1 :])
        if len(ids) < n_tokens + 8:
            continue
        out.append({"file": rel, "ids": ids[:n_tokens]})
        if len(out) == count:
            break
    return out


def handoff(exact: ExactEngine, dec: DecodeEngine, ids: list[int], engine: str, keep: bool = False):
    """ExactEngine prefill -> export -> DecodeEngine.load (copies, as the wire does)."""
    s, first = exact.prefill(ids)
    tensors, pos, nxt = exact.export(s.id)
    sess = dec.load({t.name: t.tensor.clone() for t in tensors}, position=pos, next_token=nxt, engine=engine)
    if not keep:
        exact.release(s.id)
    return s, sess, first


def run_decode(exact, dec, ids, engine, n, eos, k):
    _, sess, first = handoff(exact, dec, ids, engine)
    return decode_loaded(dec, sess, first, n, eos, k)


def decode_loaded(dec, sess, first, n, eos, k):
    """Decodes a loaded session to EOS or n tokens, then releases it -> (tokens, stats)."""
    out, per_round = [first], []  # per_round: tokens each decode step yielded (m + 1, cut at the end)
    if first not in eos:
        for batch in dec.decode(sess.id, n - 1, eos_ids=eos, k=k):
            out += batch
            per_round.append(len(batch))
    stats = {"rounds": sess.rounds, "emitted_in_rounds": sess.emitted_in_rounds, "per_round": per_round}
    dec.release(sess.id)
    return out, stats


def run_batched_mtp(exact, lm, prompts, max_len, n, eos, k):
    """Every prompt's mtp decode at once on one DecodeEngine (concurrent rounds verify in one pass:
    DecodeEngine._mtp_batched, the rounds scheduler) -> ([(tokens, stats)] in prompt order, the largest round batch)."""
    r = ModelRunner(lm.model, slots=len(prompts), max_len=max_len)
    if r.device.type == "cuda":  # as the decode worker serves on CUDA: rounds chain and verify as one batch
        r.enable_batching()
    dec = DecodeEngine({"bf16": r, "mtp": r}, default_engine="mtp", draft_length="fixed")
    loaded = [handoff(exact, dec, pr["ids"], "mtp") for pr in prompts]  # one at a time: exact has 2 slots

    def one(i):
        _, sess, first = loaded[i]
        return decode_loaded(dec, sess, first, n, eos, k)

    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(one, range(len(prompts))))
    return outs, dec.mtp_round_max


def run_exact_fp8(exact, dec8, ids, n, eos, k):
    """The router's exact mode in miniature: FP8 drafts, exact verification."""
    es, sess, first = handoff(exact, dec8, ids, "fp8", keep=True)
    out, verdict, rounds, drafted, accepted, per_round = [first], None, 0, 0, 0, []
    try:
        while len(out) < n and out[-1] not in eos:
            drafts = dec8.draft(sess.id, k, verdict)
            v = exact.verify(es.id, [out[-1]] + drafts)
            out += drafts[: v.accepted] + [v.next_token]
            verdict = (v.accepted, v.next_token)
            rounds, drafted, accepted = rounds + 1, drafted + k, accepted + v.accepted
            per_round.append(v.accepted)
    finally:
        exact.release(es.id)
        dec8.release(sess.id)
    for i, t in enumerate(out):  # cut as the router would: at EOS / n tokens
        if t in eos:
            out = out[: i + 1]
            break
    return out[:n], {"rounds": rounds, "drafted": drafted, "accepted": accepted, "per_round": per_round}


def early(per_round: list[int], limit: int, emitted) -> list[int]:
    """The rounds that start within the first `limit` generated tokens (before greedy loops set in)."""
    out, pos = [], 1
    for x in per_round:
        if pos >= limit:
            break
        out.append(x)
        pos += emitted(x)
    return out


@torch.no_grad()
def hf_parity(model_dir, lm, ids):
    from transformers import Qwen3_5ForCausalLM as HF

    from baton.models.qwen3_5 import StepContext

    hf = HF.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ref = hf(torch.tensor([ids])).logits[0]
    r = ModelRunner(lm.model, max_len=len(ids) + 16)
    r.state.reset(0)
    h = lm.model(torch.tensor(ids), r.state, StepContext(slot=0, width=None, n=len(ids)))
    ours = lm.model.logits(h)
    return {
        "prompt_tokens": len(ids),
        "max_abs_diff_logits": float((ours - ref).abs().max()),
        "logit_scale_max_abs": float(ref.abs().max()),
        "argmax_agree": float((ours.argmax(-1) == ref.argmax(-1)).float().mean()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (the GPU figure of issue 21's batched MTP acceptance)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--k-mtp", type=int, default=3)
    p.add_argument("--k-fp8", type=int, default=4)
    p.add_argument("--early", type=int, default=32, help="also report rounds within the first N new tokens")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers parity check")
    p.add_argument("--no-batched", action="store_true", help="skip the batched mtp run (every prompt at once)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    t_start = time.time()
    d = resolve_model_dir(a.model)
    tok = Tokenizer.from_dir(d)
    lm = load_model(d, dtype=a.dtype, device=a.device, mtp=True)
    eos = tuple(lm.cfg.eos_token_ids)
    max_len = a.prompt_tokens + a.new + 32
    prompts = heldout_prompts(tok, a.prompt_tokens, a.prompts)

    exact = ExactEngine(ModelRunner(lm.model, slots=2, max_len=max_len))
    r = ModelRunner(lm.model, slots=1, max_len=max_len)
    dec = DecodeEngine({"bf16": r, "mtp": r}, default_engine="mtp", draft_length="fixed")
    fp8_model = copy.deepcopy(lm.model)
    del fp8_model.mtp  # fp8 sessions never draft with the MTP head (decode_worker/service.py)
    q = quantize_model(fp8_model, "full")
    dec8 = DecodeEngine({"fp8": ModelRunner(fp8_model, slots=1, max_len=max_len)}, default_engine="fp8")

    rows, tot = (
        [],
        {
            "mtp_rounds": 0,
            "mtp_emitted": 0,
            "fp8_rounds": 0,
            "fp8_drafted": 0,
            "fp8_accepted": 0,
            "fp8_emitted": 0,
            "tokens": 0,
        },
    )
    all_identical, first_ref = True, None
    for pr in prompts:
        ids = pr["ids"]
        t0 = time.perf_counter()
        ref = exact.generate(ids, a.new, eos_ids=eos)
        t_ref = time.perf_counter() - t0
        first_ref = ref if first_ref is None else first_ref
        bf16, _ = run_decode(exact, dec, ids, "bf16", a.new, eos, a.k_mtp)
        t0 = time.perf_counter()
        mtp, ms = run_decode(exact, dec, ids, "mtp", a.new, eos, a.k_mtp)
        t_mtp = time.perf_counter() - t0
        fp8, fs = run_exact_fp8(exact, dec8, ids, a.new, eos, a.k_fp8)
        same = {"bf16": bf16 == ref, "mtp": mtp == ref, "exact_fp8": fp8 == ref}
        all_identical &= all(same.values())
        rows.append(
            {
                "file": pr["file"],
                "prompt": tok.decode(ids),
                "new_tokens": len(ref),
                "continuation": tok.decode(ref),
                "identical_to_exact_ar": same,
                "mtp": {
                    **ms,
                    "accept_len_per_round": ms["emitted_in_rounds"] / max(ms["rounds"], 1),
                    "emitted_after_cut": len(mtp) - 1,
                },
                "exact_fp8": {
                    **fs,
                    "acceptance_rate": fs["accepted"] / max(fs["drafted"], 1),
                    "tokens_per_round": (len(fp8) - 1) / max(fs["rounds"], 1),
                },
                "seconds": {"exact_ar": round(t_ref, 3), "mtp_decode": round(t_mtp, 3)},
                "mtp_tokens": mtp,  # dropped before printing: the batched run is checked against it
            }
        )
        tot["mtp_rounds"] += ms["rounds"]
        tot["mtp_emitted"] += ms["emitted_in_rounds"]
        tot["mtp_after_cut"] = tot.get("mtp_after_cut", 0) + len(mtp) - 1
        tot["fp8_rounds"] += fs["rounds"]
        tot["fp8_drafted"] += fs["drafted"]
        tot["fp8_accepted"] += fs["accepted"]
        tot["fp8_emitted"] += len(fp8) - 1
        tot["tokens"] += len(ref)
        em = early(ms["per_round"], a.early, lambda x: x)
        ef = early(fs["per_round"], a.early, lambda x: x + 1)
        tot["early_mtp"] = tot.get("early_mtp", []) + em
        tot["early_fp8"] = tot.get("early_fp8", []) + ef
        print(
            f"{pr['file']}: mtp {rows[-1]['mtp']['accept_len_per_round']:.2f}/round, "
            f"fp8 {rows[-1]['exact_fp8']['acceptance_rate']:.1%}, identical {same}",
            file=sys.stderr,
        )

    batched = None
    if not a.no_batched:  # the same prompts' mtp decodes all at once: rounds of several sessions per pass
        t0 = time.perf_counter()
        outs, widest = run_batched_mtp(exact, lm, prompts, max_len, a.new, eos, a.k_mtp)
        rounds = sum(st["rounds"] for _, st in outs)
        emitted = sum(st["emitted_in_rounds"] for _, st in outs)
        same_tokens = [o == x["mtp_tokens"] for (o, _), x in zip(outs, rows)]
        same_rounds = [st["per_round"] == x["mtp"]["per_round"] for (_, st), x in zip(outs, rows)]
        all_identical &= all(same_tokens)
        batched = {
            "sessions": len(prompts),
            "largest_round_batch": widest,
            "rounds": rounds,
            "accept_len_per_round": emitted / max(rounds, 1),
            "tokens_identical_to_alone": all(same_tokens),
            "rounds_identical_to_alone": all(same_rounds),
            "seconds": round(time.perf_counter() - t0, 3),
        }
        print(f"batched mtp: {batched}", file=sys.stderr)
    for x in rows:
        x.pop("mtp_tokens")

    result = {
        "benchmark": "acceptance_default_model",
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join(shlex.quote(x) for x in [os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
        },
        "model": {
            "dir": os.path.relpath(d, ROOT) if str(d).startswith(str(ROOT)) else str(d),
            "fingerprint": lm.fingerprint,
            "dtype": a.dtype,
            "vocab": lm.cfg.vocab_size,
        },
        "setup": {
            "prompts": len(prompts),
            "prompt_tokens": a.prompt_tokens,
            "max_new_tokens": a.new,
            "stop": "EOS or max_new_tokens",
            "greedy": True,
            "width": r.width,
            "prompt_source": "first def of held-out stdlib files (sha256(relpath) mod 20 == 0), "
            f"Python {platform.python_version()} stdlib",
        },
        "mtp": {
            "K": a.k_mtp,
            "rounds": tot["mtp_rounds"],
            "tokens_in_rounds": tot["mtp_emitted"],
            "accept_len_per_round": tot["mtp_emitted"] / max(tot["mtp_rounds"], 1),
            "accept_len_per_round_after_cut": tot["mtp_after_cut"] / max(tot["mtp_rounds"], 1),
            "note": "accept_len_per_round = the engine's mean_accept_len (m + 1 per round, the bonus token "
            "included; the last round may pass max_new_tokens); _after_cut counts only tokens kept",
            "per_prompt": [x["mtp"]["accept_len_per_round"] for x in rows],
            f"first_{a.early}_tokens": {
                "rounds": len(tot["early_mtp"]),
                "accept_len_per_round": sum(tot["early_mtp"]) / max(len(tot["early_mtp"]), 1),
            },
            "batched": batched,
        },
        "exact_fp8": {
            "K": a.k_fp8,
            "fp8_mode": "full",
            "fp8_modules_replaced": q["replaced"],
            "rounds": tot["fp8_rounds"],
            "drafted": tot["fp8_drafted"],
            "accepted": tot["fp8_accepted"],
            "acceptance_rate": tot["fp8_accepted"] / max(tot["fp8_drafted"], 1),
            "tokens_per_round": tot["fp8_emitted"] / max(tot["fp8_rounds"], 1),
            "per_prompt": [x["exact_fp8"]["acceptance_rate"] for x in rows],
            f"first_{a.early}_tokens": {
                "rounds": len(tot["early_fp8"]),
                "acceptance_rate": sum(tot["early_fp8"]) / max(a.k_fp8 * len(tot["early_fp8"]), 1),
            },
        },
        "all_paths_identical_to_exact_ar": all_identical,
        "tokens_generated_per_path": tot["tokens"],
        "hf_parity": None if a.no_hf else hf_parity(d, lm, prompts[0]["ids"] + first_ref),
        "prompts": rows,
        "seconds_total": None,
    }
    result["seconds_total"] = round(time.time() - t_start, 1)
    print(json.dumps(result, indent=1))
    return 0 if all_identical else 1


if __name__ == "__main__":
    sys.exit(main())
