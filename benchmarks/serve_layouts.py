"""bench_serve --layout: the same points with the prefill and decode workers on two GPUs and on one.

    split    prefill-0 on GPU 0, decode-0 on GPU 1: plain `baton serve --processes --device cuda` with two
             or more GPUs visible (deploy/processes.py start_processes gives each cuda worker its own GPU);
             needs --device cuda and two visible GPUs (baton/gpus.py visible_gpus): else `--layout split`
             is refused before anything runs, and `--layout both` records split as skipped, with the reason
    shared   both workers on GPU 0: `baton serve ... --colocate` (on the CPU: the plain serve); on cuda
             the launcher has the two agree on their KV budgets (BATON_GPU_WORKERS / BATON_GPU_PLAN,
             baton/engine/gpu_plan.py)
    both     split, then shared, in one run: one prepare (references, HF, bandwidth), one `baton serve`
             per layout, every point in each

Per layout the JSON has `layouts.NAME`: gpus (2 split, 1 shared; the CPU counts as one), serve_args, the
serve's argv and boot, placement (worker -> GPU, from `baton serve`'s "NAME on GPU X" lines; a split whose
prefill and decode workers did not land on two GPUs is `failed` and its points dropped), or skipped.
Each point gets layout, gpus, goodput_per_gpu (tok_s / gpus). `comparison`: per point run in both layouts,
each metric of METRICS in both and the winner; `verdict`: one computed sentence per metric.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

LAYOUTS = ("split", "shared")
GPUS = {"split": 2, "shared": 1}
# metric -> (label, better, unit scale, unit)
METRICS = {
    "tok_s": ("output tok/s", "higher", 1.0, ""),
    "goodput_per_gpu": ("goodput per GPU (tok/s / GPUs)", "higher", 1.0, ""),
    "ttft_s_p50": ("TTFT p50", "lower", 1.0, " s"),
    "ttft_s_p99": ("TTFT p99", "lower", 1.0, " s"),
    "itl_s_p50": ("inter-token p50", "lower", 1e3, " ms"),
    "itl_s_p99": ("inter-token p99", "lower", 1e3, " ms"),
    "decode_step_s_p99": ("decode step p99", "lower", 1e3, " ms"),
}
_ON_GPU = re.compile(r"^baton: (\w+-\d+) on GPU (\S+)$")


def parse(text: str | None) -> list[str]:
    """--layout value -> the layouts to run, in order ([] without --layout: one serve, as given)."""
    if not text:
        return []
    if text == "both":
        return list(LAYOUTS)
    if text not in LAYOUTS:
        raise SystemExit(f"--layout: split, shared or both, got {text!r}")
    return [text]


def split_unavailable(device: str, env: Mapping[str, str] | None = None) -> str | None:
    """Why the split layout cannot run here, or None."""
    from baton.gpus import visible_gpus

    if device != "cuda":
        return f"the split layout needs --device cuda and two GPUs (--device {device})"
    n = len(visible_gpus(env))
    if n < 2:
        return f"the split layout needs two GPUs, {n} visible (CUDA_VISIBLE_DEVICES / the NVIDIA driver)"
    return None


def refuse(layouts: list[str], device: str, env: Mapping[str, str] | None = None) -> None:
    """SystemExit when only split is asked for and it cannot run (never run it shared instead)."""
    why = split_unavailable(device, env) if layouts == ["split"] else None
    if why:
        raise SystemExit(f"bench_serve: --layout split refused: {why}; --layout shared runs on one")


def plan(layouts: list[str], device: str, serve_args: str = "", env: Mapping[str, str] | None = None) -> dict:
    """name -> {gpus, serve_args (added to `baton serve`), skipped (reason) where it cannot run}."""
    out = {}
    for name in layouts:
        lay: dict = {"gpus": GPUS[name], "serve_args": []}
        if name == "split":
            why = split_unavailable(device, env)
            if why:
                lay["skipped"] = why
        elif device == "cuda":
            lay["serve_args"] = ["--colocate"]  # the two agree on their KV budgets (gpu_plan.py)
        out[name] = lay
    return out


def placement(err_lines: list[str]) -> dict[str, str]:
    """worker -> GPU (CUDA_VISIBLE_DEVICES value) from `baton serve`'s progress lines; {} = inherited."""
    return {m.group(1): m.group(2) for ln in err_lines if (m := _ON_GPU.match(ln.strip()))}


def placement_problem(layout: str, where: dict[str, str], device: str) -> str | None:
    """Why the workers did not run where `layout` says, or None."""
    if device != "cuda":
        return None
    pre = {g for w, g in where.items() if w.startswith("prefill-")}
    dec = {g for w, g in where.items() if w.startswith("decode-")}
    if layout == "split" and (not pre or not dec or pre & dec):
        return f"prefill and decode workers not on separate GPUs: {where or 'no placement lines'}"
    if layout == "shared" and len(set(where.values())) > 1:
        return f"workers on several GPUs: {where}"
    return None


def annotate(points: list[dict], layout: str, gpus: int) -> list[dict]:
    for p in points:
        p["layout"], p["gpus"] = layout, gpus
        p["goodput_per_gpu"] = round(p["tok_s"] / gpus, 2) if p.get("tok_s") is not None else None
    return points


def label(p: dict) -> str:
    if p.get("mode") == "rate":
        return f"{p['workload']} {p['rate']:g} req/s"
    return f"{p['workload']} N={p['concurrency']}"


def _key(p: dict) -> tuple:
    return (p["workload"], p["mode"], p.get("concurrency") or 0, p.get("rate") or 0)


def compare(points: list[dict]) -> list[dict]:
    """Every point run in both layouts: per metric {split, shared, winner, ratio (worse / better, >= 1)}."""
    by: dict[tuple, dict[str, dict]] = {}
    for p in points:
        if p.get("layout") in LAYOUTS:
            by.setdefault(_key(p), {})[p["layout"]] = p
    rows = []
    for k in sorted(by, key=lambda k: (k[0], k[1], k[2], k[3] if math.isfinite(k[3]) else 1e300)):
        pair = by[k]
        if len(pair) < 2:
            continue
        row = {"point": label(pair["split"]), "workload": k[0], "mode": k[1]}
        for m, (_, better, _, _) in METRICS.items():
            a, b = pair["split"].get(m), pair["shared"].get(m)
            cell = {"split": a, "shared": b, "winner": None, "ratio": None}
            if a is not None and b is not None and a > 0 and b > 0:
                if a == b:
                    cell["winner"], cell["ratio"] = "tie", 1.0
                else:
                    cell["winner"] = "split" if (a > b) == (better == "higher") else "shared"
                    cell["ratio"] = round(max(a, b) / min(a, b), 3)
            row[m] = cell
        rows.append(row)
    return rows


def verdict(rows: list[dict], layouts: dict | None = None) -> list[str]:
    """One plain sentence per metric: which layout wins at which points, by how much (computed)."""
    not_run = {n: lay.get("skipped") or lay.get("failed") for n, lay in (layouts or {}).items()}
    not_run = {n: why for n, why in not_run.items() if why}
    if not rows:
        why = "; ".join(f"{n}: {w}" for n, w in not_run.items()) or "no point ran in both layouts"
        return [f"No comparison: {why}."]
    out = []
    for m, (name, better, scale, unit) in METRICS.items():
        cells = [(r["point"], r[m]) for r in rows if r[m]["winner"]]
        if not cells:
            continue
        parts = []
        for lay in LAYOUTS:
            won = [(pt, c) for pt, c in cells if c["winner"] == lay]
            if not won:
                continue
            lo, hi = min(c["ratio"] for _, c in won), max(c["ratio"] for _, c in won)
            top_pt, top = max(won, key=lambda x: x[1]["ratio"])
            by = f"{lo:.2f}x" if lo == hi else f"{lo:.2f}x to {hi:.2f}x"
            parts.append(
                f"{lay} at {len(won)} of {len(cells)} ({', '.join(pt for pt, _ in won)}), "
                f"{'ahead' if better == 'higher' else 'lower'} by {by} (most at {top_pt}: "
                f"{_num(top[lay], scale, unit)} against {_num(top[_other(lay)], scale, unit)}{unit})"
            )
        ties = [pt for pt, c in cells if c["winner"] == "tie"]
        if ties:
            parts.append(f"equal at {', '.join(ties)}")
        out.append(f"{name[0].upper()}{name[1:]} ({better} is better): " + "; ".join(parts) + ".")
    return out


def _num(v: float, scale: float, unit: str) -> str:
    v *= scale
    return f"{v:.3f}" if unit == " s" else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _other(lay: str) -> str:
    return "shared" if lay == "split" else "split"


def _fmt(x, scale: float = 1.0, nd: int = 1) -> str:
    return "" if x is None else f"{x * scale:.{nd}f}"


def markdown(res: dict) -> str:
    """The layouts, the side-by-side table (split / shared in each cell) and the verdict."""
    lays = res.get("layouts") or {}
    lines = ["## Layouts: prefill and decode on two GPUs (split) against one (shared)\n"]
    lines += ["| layout | GPUs | `baton serve` | placement | status |", "|---|---|---|---|---|"]
    for name, lay in lays.items():
        where = ", ".join(f"{w} on GPU {g}" for w, g in lay.get("placement", {}).items()) or "inherited"
        status = (
            f"skipped: {lay['skipped']}"
            if lay.get("skipped")
            else f"FAILED: {lay['failed']}"
            if lay.get("failed")
            else "ran"
        )
        argv = lay.get("serve", {}).get("argv", "")
        lines.append(f"| {name} | {lay.get('gpus')} | `{argv}` | {where if 'serve' in lay else ''} | {status} |")
    rows = compare(res.get("points", []))
    if rows:
        head = " | ".join(f"{n}{u and f' ({u.strip()})'}" for n, _, _, u in METRICS.values())
        lines += ["", "Each cell: split / shared; the better one in bold.", "", f"| point | {head} |"]
        lines.append("|---|" + "---|" * len(METRICS))
        for r in rows:
            cells = []
            for m, (_, _, scale, unit) in METRICS.items():
                c, nd = r[m], 3 if unit == " s" else 1
                a, b = _fmt(c["split"], scale, nd), _fmt(c["shared"], scale, nd)
                a, b = (f"**{a}**" if c["winner"] == "split" else a), (f"**{b}**" if c["winner"] == "shared" else b)
                cells.append(f"{a} / {b}")
            lines.append(f"| {r['point']} | " + " | ".join(cells) + " |")
    lines += ["", "**Which layout wins** (computed from the points above):", ""]
    lines += [f"- {s}" for s in verdict(rows, lays)]
    return "\n".join(lines) + "\n"


def plot(res: dict, path, plt) -> None:
    """One panel per metric: grouped bars, split beside shared, at every point either layout ran."""
    pts = [p for p in res.get("points", []) if p.get("layout") in LAYOUTS]
    keys = sorted({_key(p) for p in pts}, key=lambda k: (k[0], k[1], k[2], k[3] if math.isfinite(k[3]) else 1e300))
    by = {(_key(p), p["layout"]): p for p in pts}
    names = {k: label(by.get((k, "split")) or by[(k, "shared")]) for k in keys}
    fig, axes = plt.subplots(2, 4, figsize=(22, 8.5))
    axes = axes.ravel()
    xs = range(len(keys))
    for ax, (m, (name, better, scale, unit)) in zip(axes, METRICS.items()):
        for j, lay in enumerate(LAYOUTS):
            ys = [(by.get((k, lay)) or {}).get(m) for k in keys]
            ran = "" if any((k, lay) in by for k in keys) else ", not run"
            ax.bar(
                [x + (j - 0.5) * 0.4 for x in xs],
                [0 if y is None else y * scale for y in ys],
                width=0.4,
                label=f"{lay} ({GPUS[lay]} GPU{'s' * (GPUS[lay] > 1)}{ran})",
            )
        ax.set_xticks(list(xs), [names[k] for k in keys], rotation=45, ha="right", fontsize=7)
        ax.set_title(f"{name}{unit and f' ({unit.strip()})'}, {better} is better", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    text = axes[-1]
    text.axis("off")
    words = "\n\n".join(verdict(compare(res.get("points", [])), res.get("layouts")))
    text.text(0, 1, _wrap(words, 60), va="top", fontsize=6.5, family="monospace")
    m = res.get("machine", {})
    fig.suptitle(
        f"{m.get('gpu') or m.get('cpu') or ''}: split (prefill GPU 0, decode GPU 1) against shared (both GPU 0)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.fill(par, width) if par else "" for par in text.split("\n"))
