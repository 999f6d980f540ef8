"""Is a prompt's state the same whatever grid its pieces are cut on? A probe, CPU or GPU; prints JSON.

The prefill worker's prefix cache keeps states only at PREFILL_CHUNK (8,192-token) boundaries, because a prompt
is always cut there and its state is exact only as a function of its pieces (baton/engine/prefix_cache.py). A
finer cache (say at every 256-token page) would restore a state at a boundary the reference never cut at, so it
is exact only if cutting a prompt at such a boundary leaves bitwise the state of the prompt computed whole.
This probe measures that: a prompt of --tokens tokens computed whole (pieces of --chunk), against the same
prompt computed as pieces of each --grains size (ModelRunner.prefill_chunk = grain, so cut at every multiple),
and reports, per grain, the first token's equality and the state tensors (GDN conv / recurrent, KV, hidden,
MTP KV) that differ.

    python benchmarks/probe_cut_invariance.py                                   # CPU: the embedded-shape tiny model
    python benchmarks/probe_cut_invariance.py --device cuda --shape qwen3.5-9b --tokens 2600 --grains 256,1024
"""

from __future__ import annotations

import argparse
import datetime
import random
import shlex
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.report import emit  # noqa: E402


def _model(args):
    from baton.loading import load_model, random_model

    if args.shape:
        from baton.random_init import shape

        return random_model(shape(args.shape), dtype=args.dtype, device=args.device, seed=0, mtp=True)
    from baton.random_checkpoint import make_random_checkpoint

    return load_model(make_random_checkpoint(Path(tempfile.mkdtemp()) / "m"), dtype=args.dtype, device=args.device)


def _state(r, slot: int) -> dict:
    out = {t.name: t.materialize().clone() for t in r.state.export(slot)}
    out["position"], out["next_token"] = int(r.state.position[slot]), int(r.state.next_token[slot])
    return out


def probe(lm, tokens: int, chunk: int, grains: list[int], device: str) -> dict:
    import torch

    from baton.engine.runner import ModelRunner

    def runner(grain: int) -> ModelRunner:
        r = ModelRunner(lm.model, slots=2, max_len=tokens + 64, width=16 if device == "cuda" else 8)
        r.prefill_chunk = grain
        return r

    ids = [random.Random(0).randrange(lm.cfg.vocab_size) for _ in range(tokens)]
    whole = runner(chunk)
    tok = whole.prefill(0, ids)
    ref = _state(whole, 0)
    out = {}
    for g in grains:
        r = runner(g)
        got_tok = r.prefill(0, ids)
        got = _state(r, 0)
        differ = [
            k
            for k in ref
            if not (torch.equal(ref[k], got[k]) if isinstance(ref[k], torch.Tensor) else ref[k] == got[k])
        ]
        out[str(g)] = {"pieces": -(-tokens // g), "first_token_equal": got_tok == tok, "tensors_differing": differ}
    return out


def main(argv: list[str] | None = None) -> int:
    import platform

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="bf16", help="bf16 or fp32")
    p.add_argument("--shape", default=None, help="a random-init shape (e.g. qwen3.5-9b); default: the tiny model")
    p.add_argument("--tokens", type=int, default=700, help="the prompt's length")
    p.add_argument("--chunk", type=int, default=8192, help="the whole prompt's piece size (the reference's)")
    p.add_argument("--grains", default="64,256,512,300", help="piece sizes to cut at (a non-multiple of 64 too)")
    p.add_argument("--machine", default=platform.platform(), help="recorded in the JSON")
    p.add_argument("--out", default=None, help="the JSON's path (else stdout only)")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    lm = _model(a)
    res = {
        "benchmark": "cut_invariance",
        "command": shlex.join(["python", "benchmarks/probe_cut_invariance.py", *(argv or sys.argv[1:])]),
        "machine": a.machine,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": a.device,
        "dtype": a.dtype,
        "shape": a.shape or "tiny (baton.random_checkpoint)",
        "tokens": a.tokens,
        "grains": probe(lm, a.tokens, a.chunk, [int(x) for x in a.grains.split(",")], a.device),
    }
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
