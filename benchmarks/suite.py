"""`baton bench`: the whole benchmark suite, one command. GPU only (one GPU; the ttft part uses a second if visible).

    baton bench --random-init qwen3.5-9b                   # every part
    baton bench --parts decode,profile --out-dir DIR       # a subset (e.g. split across two GPUs)

Parts (each also runs alone; see its script):
    decode   bench_decode.py  bf16 / fp8 / mtp tok/s at each context vs HF generate vs the bandwidth floor
                              (bf16 / fp8 tok/s with the decode worker's default pipelined AR loop, and
                              the plain loop too in the same run, --pipeline-ab),
                              graph capture time and pool bytes per engine, peak GPU memory
    profile  profile_step.py  per-part GPU time of one step (GEMM, GDN, attention, norms, ...), kernels/step
    ttft     bench_ttft.py    TTFT: prefill alone vs prefill + hand-off to a decode worker, prefill MFU
                              (with 2+ GPUs visible the decode worker gets the second, --decode-gpu 1: the
                              disaggregated layout; on one GPU the two processes time-slice it)
    bridge   bench_bridge.py  state hand-off GB/s over loopback gRPC (device -> wire -> device)
    exact    bench_exact.py   exact mode through the router (workers as processes) vs bf16 AR: real FP8 /
                              MTP drafts, the acceptance-controlled drafter at FP8-step cost, the analytic bound
    exact_mtp bench_exact.py  the acceptance-controlled drafter at the cost of an MTP chain (K=8)
    serve    bench_serve.py   concurrent streams through `baton serve --processes` (bf16; 512-token prompts,
                              --new tokens; N = 1, 8, 32, 64, 128) against HF generate at batch N and the
                              bandwidth floor at N; writes its own .md and .png beside its JSON
    serve_fp8 bench_serve.py  the same with the fp8 engine (N = 1, 8, 32)
serve and serve_fp8 are not in the default --parts (they start servers of their own): ask for them.
Writes <out-dir>/<date>-<machine>.json (decode), <stem>-<part>.json for the others, <stem>.md with every
part's headline figures, and <stem>.png (tok/s against context, HF and the floor drawn).
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--random-init", default="qwen3.5-9b", help="model shape built in memory (see baton/random_init.py)")
    p.add_argument("--contexts", default="512,8192,32768")
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--engines", default="bf16,fp8,mtp")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--parts", default="decode,profile,ttft,bridge,exact,exact_mtp")


def markdown(res: dict) -> str:
    """The decode table. tok/s is what bench_decode measured by default: bf16 / fp8 with the pipelined AR
    loop when res["pipeline"] (older files: false, the plain loop); the A/B columns when present."""
    loop = "pipelined AR loop for bf16 / fp8" if res.get("pipeline") else "plain AR loop"
    lines = [
        f"tok/s: the {loop}.\n",
        "| engine | context | tok/s | floor tok/s | % of floor | plain AR tok/s | pipelined AR tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["results"]:
        ab = "tok_s_pipelined" in r
        plain = r.get("tok_s_plain", r["tok_s"] if ab and not res.get("pipeline") else None)
        pp = f"{r['tok_s_pipelined']:.1f}" + ("" if r.get("tokens_equal_plain") else " (TOKENS DIFFER)") if ab else ""
        lines.append(
            f"| {r['engine']} | {r['context']} | {r['tok_s']:.1f} | {r['floor_tok_s']:.1f} | "
            f"{100 * r['pct_of_floor']:.0f}% | {'' if plain is None else f'{plain:.1f}'} | {pp} |"
        )
    if "hf_generate" in res:
        h = res["hf_generate"]
        lines.append(f"| HF generate | {h['context']} | {h['tok_s']:.1f} | | | | |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for e in sorted({r["engine"] for r in res["results"]}):
        rows = [r for r in res["results"] if r["engine"] == e]
        ax.plot([r["context"] for r in rows], [r["tok_s"] for r in rows], marker="o", label=f"baton {e}")
    bf = [r for r in res["results"] if r["engine"] == "bf16"]
    ax.plot([r["context"] for r in bf], [r["floor_tok_s"] for r in bf], "k--", label="bf16 bandwidth floor")
    if "hf_generate" in res:
        ax.axhline(res["hf_generate"]["tok_s"], color="grey", linestyle=":", label="HF generate")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _script(part: str, args, js: Path) -> list[str]:
    py = [sys.executable, str(Path(__file__).resolve().parent / f"{SCRIPTS[part]}.py")]
    shape = ["--random-init", args.random_init]
    if part == "profile":
        return py + shape + ["--context", "512", "--out", str(js)]
    if part == "ttft":
        return (
            py
            + shape
            + [
                "--device",
                "cuda",
                "--prompts",
                "512,4096,32768",
                "--runs",
                str(args.runs),
                "--decode-worker",
                "process",
                "--sender",
                "process,thread",
                "--tail-chunk-mib",
                "1,0",
                "--out",
                str(js),
            ]
            + (["--decode-gpu", "1"] if _gpus() > 1 else [])
        )
    if part == "bridge":
        return py + ["--device", "cuda", "--repeats", str(args.runs), "--out", str(js)]
    if part in ("serve", "serve_fp8"):
        fp8 = part == "serve_fp8"
        return py + [
            "--device",
            "cuda",
            "--random-init",
            args.random_init,
            "--engine",
            "fp8" if fp8 else "bf16",
            "--concurrency",
            "1,8,32" if fp8 else "1,8,32,64,128",
            "--input-len",
            "512",
            "--output-len",
            str(args.new),
            "--out",
            str(js),
        ]
    exact = (
        py
        + shape
        + [
            "--device",
            "cuda",
            "--prompt-len",
            "512",
            "--new",
            "512",
            "--real-new",
            "128",
            "--runs",
            str(args.runs),
            "--ps",
            "0.8,0.9,0.95,0.99",
            "--out",
            str(js),
        ]
    )
    if part == "exact_mtp":  # controlled drafter at the cost of an MTP chain (real drafts: in "exact")
        return exact + ["--ks", "8", "--drafters", "", "--controlled-engine", "mtp"]
    return exact + ["--ks", "4,8"]


SCRIPTS = {
    "serve": "bench_serve",
    "serve_fp8": "bench_serve",
    "profile": "profile_step",
    "ttft": "bench_ttft",
    "bridge": "bench_bridge",
    "exact": "bench_exact",
    "exact_mtp": "bench_exact",
}


def summary(part: str, res: dict) -> list[str]:
    """Headline lines of one part's JSON for the Markdown report."""
    if part == "profile":
        return [
            f"- {r['engine']} {r['path']}: {r['graph_ms']:.2f} ms/step ({r['tok_s']:.1f} tok/s), "
            f"{r['kernels']} kernels; " + ", ".join(f"{k} {v:.2f} ms" for k, v in r["groups_ms"].items())
            for r in res.get("runs", [])
        ]
    if part in ("serve", "serve_fp8"):
        from benchmarks.bench_serve import markdown as serve_markdown

        return serve_markdown(res).splitlines()[4:]
    if part == "bridge":
        e = res.get("results", {}).get("e2e_frames", {})
        return [
            f"- hand-off of {res.get('state', {}).get('bytes', '?')} bytes: e2e median "
            f"{e.get('median_GBps', '?')} GB/s, best {e.get('best_GBps', '?')} GB/s"
        ]
    return [
        "```json",
        json.dumps(res.get("summary", {k: v for k, v in res.items() if not isinstance(v, list)}), indent=1)[:4000],
        "```",
    ]


def run(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("baton bench: needs a CUDA GPU (absolute times only mean something there)")
        return 2
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - {"decode", *SCRIPTS}
    if unknown:
        print(f"baton bench: unknown part(s) {', '.join(sorted(unknown))}; known: decode, {', '.join(SCRIPTS)}")
        return 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today().isoformat()}-{socket.gethostname()}"
    md, rc = [], 0
    if "decode" in parts:
        from benchmarks import bench_decode

        js = out_dir / f"{stem}.json"
        bench_decode.main(
            [
                "--random-init",
                args.random_init,
                "--contexts",
                args.contexts,
                "--new",
                str(args.new),
                "--runs",
                str(args.runs),
                "--engines",
                args.engines,
                "--pipeline-ab",
                "--out",
                str(js),
            ]
        )
        res = json.loads(js.read_text())
        md.append(markdown(res))
        plot(res, out_dir / f"{stem}.png")
    for part in [p for p in parts if p != "decode"]:
        js = out_dir / f"{stem}-{part}.json"
        cmd = _script(part, args, js)
        print(f"baton bench: {part}: {' '.join(cmd)}", flush=True)
        code = subprocess.call(cmd)
        rc = rc or code
        md += [f"\n## {part}\n", f"`{' '.join(cmd[1:])}` (exit {code})\n"]
        if js.is_file():
            md += summary(part, json.loads(js.read_text()))
    (out_dir / f"{stem}.md").write_text("\n".join(md) + "\n")
    print(f"baton bench: wrote {out_dir}/{stem}.* ({', '.join(parts)})")
    return rc
