"""`baton bench`: runs the decode benchmark (ours vs HF generate vs the bandwidth floor) and writes
benchmarks/results/<date>-<machine>.json, a Markdown table beside it, and a PNG plot (tokens/s against
context per engine, with HF and the floor) when matplotlib is importable. GPU only.

    baton bench --random-init qwen3.5-9b --contexts 512,8192,32768
"""
from __future__ import annotations

import argparse
import datetime
import json
import socket
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--random-init", default="qwen3.5-9b", help="model shape built in memory (see shapes.py)")
    p.add_argument("--contexts", default="512,8192,32768")
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--engines", default="bf16,fp8,mtp")
    p.add_argument("--out-dir", default=str(RESULTS))


def markdown(res: dict) -> str:
    lines = ["| engine | context | tok/s | floor tok/s | % of floor |", "|---|---|---|---|---|"]
    for r in res["results"]:
        lines.append(f"| {r['engine']} | {r['context']} | {r['tok_s']:.1f} | {r['floor_tok_s']:.1f} | "
                     f"{100 * r['pct_of_floor']:.0f}% |")
    if "hf_generate" in res:
        h = res["hf_generate"]
        lines.append(f"| HF generate | {h['context']} | {h['tok_s']:.1f} | | |")
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


def run(args) -> int:
    import torch
    if not torch.cuda.is_available():
        print("baton bench: needs a CUDA GPU (absolute times only mean something there)")
        return 2
    from benchmarks import bench_decode
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today().isoformat()}-{socket.gethostname()}"
    js = out_dir / f"{stem}.json"
    bench_decode.main(["--random-init", args.random_init, "--contexts", args.contexts, "--new", str(args.new),
                       "--runs", str(args.runs), "--engines", args.engines, "--out", str(js)])
    res = json.loads(js.read_text())
    (out_dir / f"{stem}.md").write_text(markdown(res))
    plot(res, out_dir / f"{stem}.png")
    print(f"baton bench: wrote {js} (+ .md, .png)")
    return 0
