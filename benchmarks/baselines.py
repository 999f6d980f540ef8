"""What the decode and serving benchmarks put beside Baton's figures, and the model they run on.

    floor       the memory-bandwidth floor of one decode step of B rows, from the model config alone
                (weight_bytes, row_bytes, step_bytes, floor_tok_s): the weights read once and shared by
                every row, plus per row its GDN state read and written (recurrent state fp32, conv state in
                the model dtype), its KV up to the context and its embedding row. For the Qwen3.5-9B shape:
                15.9 GB of bf16 weights (7.9 GB fp8), 0.117 GB per row at 512 tokens of context.
    bandwidth   measured: on CUDA a large device copy (hbm_bandwidth), on the CPU a large memcpy
    HF          transformers' `generate` at batch N on the same weights (hf_generate): N same-length
                prompts, no padding; greedy; end-to-end tok/s and the decode rate without the prefill
    checkpoint  write_random_checkpoint: the seeded random weights of a named shape (baton.loading.random_model,
                what `--random-init` gives the workers) as a safetensors directory `baton serve --model` loads

Run as a script it is the preparation step of benchmarks/bench_serve.py, in its own process so that every
byte of GPU memory it used is free again before the servers start:

    python benchmarks/baselines.py (--model DIR | --random-init SHAPE [--ckpt-dir DIR] [--seed N])
        --device cuda --max-len L --jobs JOBS.json --out PREP.json
JOBS.json: {"prompts": [[ids]...], "references": {"i": n_tokens}, "sampling": {"i": {"temperature": T,
"top_p": P, "seed": S}} (optional: reference i is that seeded sampled decode), "hf_batches": [1, 8],
"hf_prompts": [i...], "hf_new": 32, "hf_runs": 1}. PREP.json: the model directory, `baton complete` tokens of each prompt i asked for
(the exact engine, the workers' dtype and window), the measured bandwidth, and HF's rate at each batch.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
MARKER = "baton-random-checkpoint.json"


# ------------------------------------------------------------------------------------------ the floor
def matmul_params(cfg) -> int:
    """Parameters of every weight matrix a decode step reads: the projections of every layer and the LM
    head (tied or not, it is read once a step). Not the embedding (one row a token: in row_bytes), the
    norms, A_log and dt_bias (vectors), nor the MTP head."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    mlp = 3 * h * inter
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    attn = h * 2 * q + 2 * h * kv + q * h  # q_proj carries the output gate: 2 * q
    hv = cfg.linear_num_value_heads
    gdn = h * cfg.conv_dim + h * cfg.value_dim + 2 * h * hv + cfg.value_dim * h  # qkv, z, b, a, out
    gdn += cfg.conv_dim * cfg.linear_conv_kernel_dim  # the depthwise conv
    n_gdn, n_attn = len(cfg.gdn_layers), len(cfg.attn_layers)
    return cfg.num_hidden_layers * mlp + n_attn * attn + n_gdn * gdn + cfg.vocab_size * h


def weight_bytes(cfg, weights: str = "bf16") -> int:
    """Bytes of weights one step reads: every matrix at `weights` (bf16: 2 bytes, fp8: 1; the fp8 scales,
    a few MB, are left out)."""
    return matmul_params(cfg) * DTYPE_BYTES[weights]


def row_bytes(cfg, context: int, *, kv_bytes: int = 2, conv_bytes: int = 2) -> int:
    """Bytes one row adds to a step at `context` tokens: its GDN recurrent state (fp32) and conv state read
    and written, its KV read up to the context (and the new row written), its embedding row."""
    rec = len(cfg.gdn_layers) * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = len(cfg.gdn_layers) * cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * conv_bytes
    kv = 2 * len(cfg.attn_layers) * cfg.num_key_value_heads * cfg.head_dim * kv_bytes * (context + 1)
    return 2 * (rec + conv) + kv + cfg.hidden_size * kv_bytes


def step_bytes(cfg, rows: int, context: int, weights: str = "bf16", kv_bytes: int = 2) -> int:
    return weight_bytes(cfg, weights) + rows * row_bytes(cfg, context, kv_bytes=kv_bytes, conv_bytes=kv_bytes)


def floor_tok_s(cfg, rows: int, context: int, bandwidth: float, weights: str = "bf16", kv_bytes: int = 2) -> float:
    """Tokens/s of all rows together if a step cost only its bytes at `bandwidth` bytes/s."""
    return rows * bandwidth / step_bytes(cfg, rows, context, weights, kv_bytes)


# ------------------------------------------------------------------------------------------ bandwidth
def hbm_bandwidth(gb: float = 4.0) -> float:
    """Read+write bytes/s of a large device copy (median of 10)."""
    import torch

    n = int(gb * 1e9 / 2)
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n * 2 / statistics.median(times[2:])


def memcpy_bandwidth(gb: float = 0.5) -> float:
    """Read+write bytes/s of a large host copy (median of 10), with torch's current threads."""
    import torch

    n = int(gb * 1e9 / 4)
    a = torch.rand(n)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    del a, b
    return 2 * n * 4 / statistics.median(times[2:])


def measure_bandwidth(device: str) -> dict:
    if str(device).startswith("cuda"):
        return {"bytes_per_s": hbm_bandwidth(), "how": "device copy of 4 GB bf16 (read + write), median of 10"}
    return {"bytes_per_s": memcpy_bandwidth(), "how": "host copy of 0.5 GB fp32 (read + write), median of 10"}


# ------------------------------------------------------------------------------------------ HF generate
def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def hf_model(model, cfg):
    """transformers' Qwen3_5ForCausalLM on the weights of a Baton model (same device and dtype)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    p = next(model.parameters())
    hc = Qwen3_5TextConfig.from_dict(cfg.hf_text_config)
    with torch.device(p.device):
        hf = Qwen3_5ForCausalLM(hc).to(p.dtype).eval()
    hf.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}, strict=False)
    return hf


class _Stamps:
    """A `generate` streamer that only stamps the time of each put: the prompt, then every new token
    (HF hands it over as a host tensor, so the step is done by then)."""

    def __init__(self):
        self.t: list[float] = []

    def put(self, value) -> None:
        self.t.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(hf, prompts: list[list[int]], new: int, runs: int = 1, warmup: bool = True) -> dict:
    """HF `generate` on a batch of same-length prompts (no padding), greedy, exactly `new` tokens each.
    tok_s: batch * new / the whole call (prefill included); decode_tok_s: batch * (new - 1) / (last token -
    first token), the steady decode rate, from a streamer's time stamps. Medians of `runs` (after one
    short warm-up call when `warmup`)."""
    import torch

    if len({len(p) for p in prompts}) != 1:
        raise ValueError("hf_generate: the prompts must have one length (no padding)")
    dev = next(hf.parameters()).device
    ids = torch.tensor(prompts, device=dev)
    b = len(prompts)

    def timed(n: int) -> tuple[float, float | None]:
        st = _Stamps()
        _sync(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=st)
        _sync(dev)
        total = time.perf_counter() - t0
        assert out.shape[1] - ids.shape[1] == n, out.shape
        news = st.t[1:]  # st.t[0]: the prompt
        return total, (news[-1] - news[0] if len(news) == n and n > 1 else None)

    if warmup:
        timed(2)
    got = [timed(new) for _ in range(runs)]
    total = statistics.median(t for t, _ in got)
    dec = [d for _, d in got if d]
    return {
        "batch": b,
        "prompt_len": ids.shape[1],
        "new_tokens": new,
        "tok_s": b * new / total,
        "decode_tok_s": b * (new - 1) / statistics.median(dec) if dec else None,
        "seconds": total,
    }


# ------------------------------------------------------------------------------------------ checkpoint
def write_random_checkpoint(spec: str, out_dir, *, seed: int = 0, device: str = "cpu", mtp: bool = False):
    """The bf16 random weights `--random-init SPEC --seed N` gives (baton.loading.random_model) written as a
    safetensors checkpoint (config.json, shards of <= 4 GB, their index; no tokenizer: prompts are token
    ids). Reused when out_dir already holds the same (spec, seed, mtp), or the same with the MTP head when
    none is asked for (the same weights; a worker loads the head and offers mtp too). Returns (dir,
    LoadedModel or None when reused, seconds)."""
    from safetensors.torch import save_file

    from baton.random_init import config_of

    out = Path(out_dir)
    want = {"random_init": spec, "seed": seed, "mtp": mtp, "dtype": "bf16"}
    marker = out / MARKER
    have = json.loads(marker.read_text()) if marker.is_file() else None
    if have == want or (not mtp and have == {**want, "mtp": True}):
        return out, None, 0.0
    from baton.loading import random_model

    t0 = time.perf_counter()
    cfg = config_of(spec)
    lm = random_model(cfg, dtype="bf16", device=device, seed=seed, mtp=mtp)
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*.safetensors"):
        f.unlink()
    sd = lm.model.state_dict()
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # the embedding's storage: a checkpoint of a tied model leaves it out
    shards, cur, size = [], {}, 0
    for name in sorted(sd):
        t = sd[name]
        nb = t.numel() * t.element_size()
        if cur and size + nb > 4e9:
            shards.append(cur)
            cur, size = {}, 0
        cur[name], size = t, size + nb
    shards.append(cur)
    weight_map = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in part.items()}, str(out / fname), {"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n"
    )
    conf = dict(cfg.hf_text_config)
    conf.update(model_type=cfg.hf_text_config.get("model_type", "qwen3_5_text"), torch_dtype="bfloat16")
    conf["mtp_num_hidden_layers"] = cfg.mtp_num_hidden_layers if mtp else 0
    (out / "config.json").write_text(json.dumps(conf, indent=1, sort_keys=True) + "\n")
    marker.write_text(json.dumps(want) + "\n")
    return out, lm, time.perf_counter() - t0


# ------------------------------------------------------------------------------------------ prepare
def prepare(a) -> dict:
    import torch

    from baton.complete import complete
    from baton.engine.sampling import Params
    from baton.loading import load_model, resolve_model_dir

    jobs = json.loads(Path(a.jobs).read_text())
    dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")
    res: dict = {"device": a.device, "dtype": dtype, "bandwidth": measure_bandwidth(a.device)}  # on an idle device
    ask = sorted(jobs.get("references", {}).items(), key=lambda kv: int(kv[0]))
    batches = jobs.get("hf_batches") or []
    lm = None
    if a.random_init:
        d, lm, sec = write_random_checkpoint(a.random_init, a.ckpt_dir, seed=a.seed, device=a.device, mtp=a.mtp)
        res["checkpoint"] = {"dir": str(d), "random_init": a.random_init, "seed": a.seed, "written_s": round(sec, 1)}
        if dtype != "bf16":
            lm = None  # the workers load the bf16 file into their dtype: so must the reference
        elif lm is None and (ask or batches):  # reused: the same seeded weights again, faster than the file
            from baton.loading import random_model
            from baton.random_init import config_of

            lm = random_model(config_of(a.random_init), dtype="bf16", device=a.device, seed=a.seed, mtp=False)
        if lm is not None and hasattr(lm.model, "mtp"):
            del lm.model.mtp
    else:
        d = resolve_model_dir(a.model)
    res["model_dir"] = str(Path(d).resolve())
    res["references"], res["hf"] = {}, {}
    if not (ask or batches):
        return res
    if lm is None:
        t0 = time.perf_counter()
        lm = load_model(d, dtype=dtype, device=a.device, mtp=False)
        res["load_s"] = round(time.perf_counter() - t0, 1)
    cfg = lm.cfg
    prompts = jobs["prompts"]
    t0 = time.perf_counter()
    sampled = jobs.get("sampling", {})  # reference i -> {temperature, top_p, seed}: a seeded sampled decode
    for i, n in ask:
        sp = Params(**sampled[i]) if i in sampled else None
        res["references"][i] = complete(
            d, prompts[int(i)], int(n), max_len=a.max_len, ignore_eos=True, loaded=lm, sampling=sp
        )
        _sync(a.device)
    res["reference_s"] = round(time.perf_counter() - t0, 1)
    hf = res["hf"]
    if batches:
        try:
            model = hf_model(lm.model, cfg)
        except Exception as e:  # noqa: BLE001 - recorded: the run goes on without HF
            hf["skipped"] = f"transformers cannot build this model: {type(e).__name__}: {e}"[:500]
            batches = []
        del lm  # HF holds its own copy of the weights: room for its activations at large batches
        gc.collect()
        pool = [prompts[i] for i in jobs.get("hf_prompts", range(len(prompts)))]
        for k, b in enumerate(batches):
            try:
                hf[str(b)] = hf_generate(
                    model, [pool[i % len(pool)] for i in range(b)], jobs["hf_new"], jobs["hf_runs"], warmup=k == 0
                )
            except Exception as e:  # noqa: BLE001 - e.g. out of memory at a large batch: recorded, go on
                hf[str(b)] = {"batch": b, "skipped": f"{type(e).__name__}: {e}"[:500]}
            print(f"baselines: HF batch {b}: {hf[str(b)]}", file=sys.stderr, flush=True)
            if torch.device(a.device).type == "cuda":
                torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/baselines.py", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    src.add_argument("--random-init", default=None, help="shape name (baton/random_init.py) or a dir with config.json")
    p.add_argument("--ckpt-dir", default=None, help="--random-init: where the checkpoint is written (or reused)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mtp", action="store_true", help="--random-init: write the MTP head too")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="the workers' dtype (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--max-len", type=int, required=True, help="the workers' window (the reference's)")
    p.add_argument("--jobs", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.random_init and not a.ckpt_dir:
        p.error("--random-init needs --ckpt-dir")
    if not a.device.startswith("cuda"):
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # as the workers (bench_serve: 1)
    res = prepare(a)
    Path(a.out).write_text(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
