"""Do fla's autotuned kernel configs change the prefill's bits? One JSON object on stdout (CUDA with fla only).

    python benchmarks/fla_config_bits.py [--random-init qwen3.5-9b] [--tokens 300] [--cut 128] [--out R.json]

Why. The prefill's delta rule is flash-linear-attention's `chunk_gated_delta_rule` (baton/models/gdn_ops.py:
chunked_segments), whose Triton kernels pick their launch configs (block sizes, warps, stages) by timing on
first use in each process. Baton's promise is bitwise the same state on any worker. Within a process that holds
(the pieces of a pass never see each other), but if two configs of one kernel round differently, two worker
processes that timed differently compute different bits. On 2026-12-06 (stop 52, an H100) a 300-token prompt
cut in 128-token pieces gave first token 482 in four processes and 83504 in one.

What it does. The GDN layer shape of --random-init (value heads, key and value head dims), random inputs of
--tokens tokens (seeded), run through the same call gdn_ops.chunked_segments makes (varlen, the final state
kept), whole and cut in --cut-token pieces (each piece from the last one's state). The first call autotunes;
every fla autotuner it used (a triton Autotuner with a cached choice) is listed. Then each such kernel is held
to each of its configs in turn (the others at their tuned choice) and the whole and the cut run again. The
output and final state of each run are hashed. Reports per kernel: its configs, the tuned one, and how many
distinct results its valid configs gave ("varies": more than one). A kernel that varies makes the bits depend
on the timing of a process's first prefill. Each config is also timed on a prefill pass's shape (--time-pass,
default 16 prompts of 512 tokens: `ms`, and `tuned_ms` for the tuned choices), so that a kernel that varies can
be pinned to its fastest config on that GPU (`gpu`) rather than chosen by each process's timing.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.models import fla_pins  # noqa: E402
from baton.random_init import config_of  # noqa: E402
from benchmarks.bench_sampling import timed  # noqa: E402
from benchmarks.report import emit, header  # noqa: E402


def _digest(*ts: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in ts:
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _inputs(cfg, T: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)

    q = torch.nn.functional.normalize(rnd(1, T, Hv, dk).float(), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(rnd(1, T, Hv, dk).float(), dim=-1).to(torch.bfloat16)
    v = rnd(1, T, Hv, dv)
    gate = -torch.nn.functional.softplus(rnd(1, T, Hv, dtype=torch.float32))  # log decay < 0
    beta = torch.sigmoid(rnd(1, T, Hv, dtype=torch.float32)).to(torch.bfloat16)
    s0 = rnd(1, Hv, dk, dv, dtype=torch.float32) * 0.1
    return q, k, v, gate, beta, s0


def _run(fla, x, cuts: list[int]) -> str:
    """The delta rule over x, in pieces ending at `cuts`, each from the last one's state -> digest."""
    q, k, v, gate, beta, s0 = x
    outs, state, lo = [], s0, 0
    for hi in cuts:
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device="cuda")
        o, state = fla(
            q[:, lo:hi].contiguous(),
            k[:, lo:hi].contiguous(),
            v[:, lo:hi].contiguous(),
            g=gate[:, lo:hi].contiguous(),
            beta=beta[:, lo:hi].contiguous(),
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=False,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu.cpu(),
        )
        outs.append(o)
        lo = hi
    torch.cuda.synchronize()
    return _digest(torch.cat(outs, dim=1), state)


def _timer(fla, cfg, seqs: int, seq_len: int, seed: int, reps: int = 5):
    """-> timed(): the delta rule over a prefill pass's shape (seqs prompts of seq_len tokens, varlen, initial
    and final states), the median ms of `reps` runs after warm-ups, by CUDA events (bench_sampling.timed)."""
    x = _inputs(cfg, seqs * seq_len, seed)
    q, k, v, gate, beta, _ = x
    s0 = torch.zeros(seqs, *x[5].shape[1:], device="cuda", dtype=torch.float32)
    cu = torch.arange(0, seqs * seq_len + 1, seq_len, dtype=torch.int32, device="cuda")
    cu_cpu = cu.cpu()

    def once():
        fla(q, k, v, g=gate, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=False,
            cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)  # fmt: skip

    return lambda: timed(once, torch.device("cuda"), reps)


def _autotuners():
    """Every triton Autotuner object in fla's loaded modules, by qualified name: a module attribute, or one a
    decorator wraps (fla stacks `@triton.heuristics` over `@fla_cache_autotune`: the attribute is the
    Heuristics, its `.fn` the autotuner; the H100 run of 2026-12-07 found none before this unwrapping)."""
    from triton.runtime.autotuner import Autotuner

    found = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.") or mod is None:
            continue
        for attr, obj in list(vars(mod).items()):
            for _ in range(4):  # Heuristics -> Autotuner -> JITFunction: a few wrappers deep at most
                if isinstance(obj, Autotuner):
                    found.setdefault(id(obj), (f"{name}.{attr}", obj))
                    break
                obj = getattr(obj, "fn", None)
                if obj is None:
                    break
    return list(found.values())


def _cfg_text(c) -> str:
    return f"{dict(c.kwargs)} w{c.num_warps} s{c.num_stages}"


def sweep(autotuners, run, timed=None) -> list[dict]:
    """autotuners [(name, Autotuner)]; run() -> the digests of one run (a dict). For each autotuner with a cached
    choice (used by the runs so far): each of its configs held alone (its cache emptied, the others' kept),
    run() again (and timed() -> ms, when given: a pass's shape, for choosing a pinned config by speed); then
    its configs and cache restored. -> per kernel: configs, the tuned ones, the valid ones, how many distinct
    results they gave, varies (more than one), and each config's result (with its ms) or error."""
    kernels = []
    for name, at in autotuners:
        if not at.cache:
            continue  # not used by these runs
        configs, cache = list(at.configs), dict(at.cache)
        tuned = sorted({_cfg_text(c) for c in cache.values()})
        runs = []
        try:
            for c in configs:
                at.configs, at.cache = [c], {}
                try:
                    runs.append({"config": _cfg_text(c), **run()})
                    if timed is not None:
                        runs[-1]["ms"] = timed()
                except Exception as e:  # noqa: BLE001 - a config this shape cannot run
                    runs.append({"config": _cfg_text(c), "error": f"{type(e).__name__}: {str(e)[:120]}"})
        finally:
            at.configs, at.cache = configs, cache
        ok = [
            tuple(sorted((k, v) for k, v in r.items() if k not in ("config", "ms"))) for r in runs if "error" not in r
        ]
        distinct = len(set(ok))
        kernels.append(
            {"kernel": name, "kernel_name": _kernel_name(at), "configs": len(configs), "tuned": tuned,
             "valid": len(ok), "distinct": distinct, "varies": distinct > 1, "runs": runs,
             "pick": _fastest(configs, runs)}
        )  # fmt: skip
    return kernels


def _kernel_name(at) -> str:
    """The name fla files a kernel's config under ({kernel}.json: its CachedAutotuner.kernel_name)."""
    fn = at.fn
    return getattr(at, "kernel_name", None) or getattr(fn, "__name__", None) or fn.fn.__name__


def _fastest(configs, runs) -> dict | None:
    """The config that ran fastest on the timed pass (the first of equals), in fla's file format; None
    without timings."""
    timed = [(r["ms"], i) for i, r in enumerate(runs) if "ms" in r]
    if not timed:
        return None
    c = configs[min(timed)[1]]
    return fla_pins.config_entry(c.kwargs, c.num_warps, c.num_stages, getattr(c, "num_ctas", 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--random-init", default="qwen3.5-9b", help="the model shape whose GDN layers are run")
    p.add_argument("--tokens", type=int, default=300, help="prompt tokens")
    p.add_argument("--cut", type=int, default=128, help="the cut run's piece length (tokens)")
    p.add_argument("--seed", type=int, default=0, help="the random inputs' seed")
    p.add_argument(
        "--time-pass", default="16x512", help="each config also timed on a pass of PROMPTSxTOKENS (empty: no timing)"
    )
    p.add_argument("--out", default="", help="also write the JSON here")
    p.add_argument(
        "--write-pins",
        default="",
        help="also write each swept kernel's fastest config as Baton's pins for this GPU under this folder"
        " (FOLDER/GPU/KERNEL.json, baton/models/fla_pins.py; needs --time-pass)",
    )
    a = p.parse_args(argv)
    res = header(__file__, argv)
    if not torch.cuda.is_available():
        res["error"] = "needs CUDA (fla's kernels are Triton on CUDA)"
        emit(res, a.out)
        return 2
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla

    cfg = config_of(a.random_init)
    x = _inputs(cfg, a.tokens, a.seed)
    whole, cut = [a.tokens], [*range(a.cut, a.tokens, a.cut), a.tokens]
    base = {"whole": _run(fla, x, whole), "cut": _run(fla, x, cut)}
    again = {"whole": _run(fla, x, whole), "cut": _run(fla, x, cut)}
    time_fn = None
    if a.time_pass:
        seqs, seq_len = (int(n) for n in a.time_pass.split("x"))
        time_fn = _timer(fla, cfg, seqs, seq_len, a.seed + 1)
        res["tuned_ms"] = time_fn()  # every kernel at its own timed choice
    kernels = sweep(_autotuners(), lambda: {"whole": _run(fla, x, whole), "cut": _run(fla, x, cut)}, time_fn)
    res |= {
        "gpu": torch.cuda.get_device_name(),
        "time_pass": a.time_pass,
        "shape": a.random_init,
        "tokens": a.tokens,
        "cut": a.cut,
        "tuned": base,
        "repeatable": base == again,
        "kernels_that_vary": [k["kernel"] for k in kernels if k["varies"]],
        "kernels": kernels,
    }
    if a.write_pins:
        import triton

        picks = {k["kernel_name"]: k["pick"] for k in kernels if k["pick"] is not None}
        files = fla_pins.write(Path(a.write_pins), torch.cuda.get_device_name(), picks, triton.__version__)
        res["pins_written"] = [str(f) for f in files]
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
