"""Train Baton's embedded default model: a Qwen3.5-text hybrid (GDN + full attention) with an MTP head.

    python deploy/train_default_model.py --out DIR [--minutes 6] [--device cuda] [--seed 0] [--smoke]

Corpus and tokenizer: deploy/default_model_corpus.py (CPython stdlib `.py` files, byte-level BPE).
Model: transformers' Qwen3_5ForCausalLM; uses flash-linear-attention kernels when `fla` is importable.
MTP head (docs/CONTRACTS.md, "MTP semantics"), for the final-normed hidden h_t and token x_{t+1}:
    u = fc(cat([pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)]))
    u = layers.0(u, causal attention over the MTP sequence, rope position t+1)
    logits = lm_head(mtp.norm(u))                       -> predicts x_{t+2}
Chained drafting (step k >= 2) feeds the previous step's mtp.norm(u) in place of h and the previous
draft token in place of x, at rope position t+k (as baton/models/mtp.py and vLLM chain it).
Sizes: hidden 256, 8 layers (full attention at 3 and 7), MLP 448, vocab 8192, tied embeddings:
7.0M main + 0.74M MTP parameters, 15.4 MB in BF16 (an MLP of 768 would exceed the 16 MB cap).
Loss = CE(next token) + sum_k w_k * CE(MTP step k), w_1 = --mtp-weight (0.3), w_k = w_1 / 2^(k-1).
The MTP branch sees detached h_t, embedding and lm_head weights, so its gradient reaches only mtp.*
and the main model is trained by the next-token loss alone (under AdamW the weight then mostly
matters for the logged total).
Writes config.json, model.safetensors, mtp.safetensors (BF16), tokenizer.json, README.md, train_log.json.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import default_model_corpus  # noqa: E402  (deploy/default_model_corpus.py)
from default_model_arch import MTPHead, losses, model_config, mtp_chain  # noqa: E402,F401
from default_model_eval import acceptance_estimate, check_mtp_causal, evaluate, greedy  # noqa: E402,F401

SIZE_LIMIT = 16_000_000  # bytes, model.safetensors + mtp.safetensors


def preflight_gdn_kernel(dev) -> float:
    """Transformers' active chunk_gated_delta_rule (fla's kernel when importable) against its own torch
    reference on random inputs, forward and backward. Returns the relative max error; raises if broken."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    fn = mq.torch_chunk_gated_delta_rule
    ref = inspect.unwrap(fn)
    g = torch.Generator().manual_seed(0)
    B, T, H, D = 2, 200, 4, 64
    q, k, v = (torch.randn(B, T, H, D, generator=g).to(dev, torch.bfloat16).requires_grad_() for _ in range(3))
    decay = F.logsigmoid(torch.randn(B, T, H, generator=g) + 2).to(dev)
    beta = torch.rand(B, T, H, generator=g).to(dev, torch.bfloat16)
    out, _ = fn(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    out.float().square().sum().backward()
    want, _ = ref(
        q.detach().float(),
        k.detach().float(),
        v.detach().float(),
        g=decay,
        beta=beta.float(),
        use_qk_l2norm_in_kernel=True,
    )
    err = ((out.detach().float() - want.float()).abs().max() / want.abs().max()).item()
    if not (math.isfinite(err) and err < 0.05) or not all(torch.isfinite(t.grad).all() for t in (q, k, v)):
        raise RuntimeError(f"GDN kernel disagrees with the torch reference (relative error {err:.3g})")
    return err


def param_count(module):
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def save_checkpoint(out: Path, config, model, mtp):
    from safetensors.torch import save_file

    sd = {
        k: v.detach().to("cpu", torch.bfloat16).contiguous()
        for k, v in model.state_dict().items()
        if not (config.tie_word_embeddings and k == "lm_head.weight")
    }
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    msd = {f"mtp.{k}": v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in mtp.state_dict().items()}
    save_file(msd, str(out / "mtp.safetensors"), metadata={"format": "pt"})
    for name in ("model.safetensors", "mtp.safetensors"):
        (out / name).chmod(0o644)
    config.save_pretrained(str(out))


def load_trained(out_dir, device="cpu"):
    """(model, mtp) from a directory this script wrote, in fp32 (used by the tests)."""
    from safetensors.torch import load_file
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).to(device).eval()
    mtp = MTPHead(model.config).to(device).eval()
    sd = load_file(str(Path(out_dir) / "mtp.safetensors"))
    mtp.load_state_dict({k.removeprefix("mtp."): v.float() for k, v in sd.items()}, strict=True)
    return model, mtp


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=6.0, help="wall-clock budget of the training loop")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="CPU-sized run: small corpus, a few steps")
    p.add_argument("--steps", type=int, default=None, help="fixed step count (default: fill --minutes)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--intermediate", type=int, default=448)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--mtp-steps", type=int, default=2, help="chained MTP steps trained (1 = contract step only)")
    p.add_argument("--eval-tokens", type=int, default=200_000)
    p.add_argument("--no-fla", action="store_true", help="force the torch GDN path even if fla is importable")
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.batch, a.seq, a.eval_tokens = "cpu", 2, 64, 1024
        a.steps = a.steps or 6
    return a


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    if args.no_fla:
        sys.modules["fla"] = None  # makes transformers fall back to its torch GDN implementation
    import transformers
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    fla = not args.no_fla and importlib.util.find_spec("fla") is not None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if dev.type == "cuda" else contextlib.nullcontext
    log = lambda msg: print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)  # noqa: E731
    if fla and dev.type == "cuda":  # a broken kernel install must not cost the whole run
        try:
            log(f"fla GDN kernel vs torch reference: relative error {preflight_gdn_kernel(dev):.2e}")
        except Exception as e:  # noqa: BLE001
            log(f"fla kernel check failed ({type(e).__name__}: {e}); restarting with --no-fla")
            os.execv(sys.executable, [sys.executable, *sys.argv, "--no-fla"])

    corpus = default_model_corpus.load_corpus(max_train_bytes=1_500_000 if args.smoke else None)
    log(f"corpus {json.dumps(corpus.stats())}")
    tok = default_model_corpus.train_tokenizer([t for _, t in corpus.train], args.vocab)
    tok.save(str(out / "tokenizer.json"))
    eos = tok.token_to_id(default_model_corpus.EOS)
    streams = {
        s: torch.from_numpy(default_model_corpus.encode_stream(tok, getattr(corpus, s), cap)).to(dev, torch.long)
        for s, cap in (("train", None), ("val", args.eval_tokens // 3), ("test", args.eval_tokens))
    }
    log(
        f"tokenizer vocab={tok.get_vocab_size()} eos={eos}; tokens "
        + " ".join(f"{s}={v.numel()}" for s, v in streams.items())
    )

    config = model_config(tok.get_vocab_size(), eos, intermediate=args.intermediate)
    model = Qwen3_5ForCausalLM(config).to(dev)
    mtp = MTPHead(config).to(dev)
    n_main, n_mtp = param_count(model), param_count(mtp)
    if 2 * (n_main + n_mtp) > SIZE_LIMIT:
        raise SystemExit(f"model too large: {n_main}+{n_mtp} params > {SIZE_LIMIT} bytes in BF16")
    check_mtp_causal(model, mtp, dev)
    log(
        f"params main={n_main} mtp={n_mtp}; fla={fla}; device={dev} "
        f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else platform.processor()}"
    )

    params = list(model.named_parameters()) + [(f"mtp.{n}", p) for n, p in mtp.named_parameters()]
    decay = [p for n, p in params if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in params if not (p.ndim >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=dev.type == "cuda",
    )
    B, T, train = args.batch, args.seq, streams["train"]
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    ar = torch.arange(T + 1, device=dev)
    budget = args.minutes * 60.0
    total = args.steps
    warmup = 2 if args.smoke else min(150, total // 10) if total else 150
    calib = (10, 40)
    val_every = None if args.smoke or not total else max(1, total // 12)
    history, vals, best = [], [], None
    step, t0, t_calib = 0, time.time(), None

    def lr_at(s):
        if s < warmup:
            return args.lr * (s + 1) / warmup
        if not total:
            return args.lr
        prog = min(1.0, (s - warmup) / max(1, total - warmup))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))

    def validate():
        nonlocal best
        model.eval(), mtp.eval()
        v = evaluate(model, mtp, streams["val"], T, 1, autocast)
        model.train(), mtp.train()
        obj = v["next_token_loss"] + args.mtp_weight * v["mtp_loss"]
        vals.append({"step": step, "val_loss": v["next_token_loss"], "val_mtp_loss": v["mtp_loss"], "objective": obj})
        log(f"val step {step}: loss {v['next_token_loss']:.4f} mtp {v['mtp_loss']:.4f}")
        if best is None or obj < best[0]:
            snap = lambda m: {k: t.detach().clone() for k, t in m.state_dict().items()}  # noqa: E731
            best = (obj, step, snap(model), snap(mtp))

    model.train(), mtp.train()
    while True:
        for g_ in opt.param_groups:
            g_["lr"] = lr_at(step)
        x = train[torch.randint(0, train.numel() - T - 1, (B,), device=dev, generator=gen)[:, None] + ar]
        with autocast():
            loss, main_ce, mtp_ce = losses(model, mtp, x, args.mtp_steps, args.mtp_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(decay + no_decay, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if dev.type == "cuda" and args.steps is None and step in calib:
            torch.cuda.synchronize()
            if step == calib[0]:
                t_calib = time.time()
            else:
                per_step = (time.time() - t_calib) / (calib[1] - calib[0])
                total = step + int(max(0.0, budget - (time.time() - t0)) / per_step * 0.97)
                val_every = max(50, total // 12)
                log(f"calibrated: {per_step * 1e3:.1f} ms/step -> {total} steps in {budget:.0f}s")
        elapsed = time.time() - t0
        done = (total is not None and step >= total) or elapsed >= budget
        if step % (1 if args.smoke else 50) == 0 or done:
            rec = {
                "step": step,
                "loss": loss.item(),
                "main": main_ce.item(),
                "mtp": [c.item() for c in mtp_ce],
                "lr": lr_at(step - 1),
                "elapsed_s": round(time.time() - t0, 2),
                "tok_per_s": round(step * B * T / (time.time() - t0)),
            }
            history.append(rec)
            log(
                f"step {step}/{total} loss {rec['main']:.4f} mtp {' '.join(f'{c:.3f}' for c in rec['mtp'])} "
                f"lr {rec['lr']:.2e} {rec['tok_per_s']} tok/s"
            )
        if done or (val_every and step % val_every == 0):
            validate()
        if done:
            break
    train_s = time.time() - t0
    model.load_state_dict(best[2]), mtp.load_state_dict(best[3])
    log(f"training done: {step} steps, {train_s:.0f}s; best val objective {best[0]:.4f} at step {best[1]}")

    # Figures come from the shipped BF16 weights, saved first so that a failure below loses nothing.
    with torch.no_grad():
        for p in list(model.parameters()) + list(mtp.parameters()):
            p.copy_(p.to(torch.bfloat16).float())
    save_checkpoint(out, config, model, mtp)
    model.eval(), mtp.eval()
    test = evaluate(model, mtp, streams["test"], T, 3, autocast)
    P, n_new, K = (16, 10, 3) if args.smoke else (64, 192, 3)
    prompts = default_model_corpus.prompts(tok, corpus.test, P, 2 if args.smoke else 8)
    seqs = greedy(model, torch.tensor(prompts, device=dev), n_new, autocast)
    accept = acceptance_estimate(model, mtp, seqs, P, K, autocast)
    log(f"held-out {json.dumps(test)}; acceptance estimate {json.dumps(accept)}")
    info = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "fla": fla,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "seed": args.seed,
        "smoke": args.smoke,
        "corpus": corpus.stats(),
        "tokens": {s: v.numel() for s, v in streams.items()},
        "vocab_size": tok.get_vocab_size(),
        "params": {"main": n_main, "mtp": n_mtp, "total": n_main + n_mtp},
        "train": {
            "steps": step,
            "batch": B,
            "seq_len": T,
            "tokens_seen": step * B * T,
            "seconds": round(train_s, 1),
            "lr": args.lr,
            "warmup": warmup,
            "mtp_weight": args.mtp_weight,
            "mtp_steps": args.mtp_steps,
            "best_step": best[1],
            "history": history,
            "val": vals,
        },
        "heldout": test,
        "acceptance_estimate": accept,
        "samples": [default_model_corpus.sample_text(tok, s, P, eos) for s in seqs.tolist()[:3]],
        "samples_new_tokens": n_new,
        "total_seconds": round(time.time() - t_start, 1),
    }
    (out / "train_log.json").write_text(json.dumps(info, indent=1) + "\n")
    (out / "README.md").write_text(default_model_corpus.model_card(info, config))
    log(f"wrote {out}: " + ", ".join(sorted(f.name for f in out.iterdir())))


if __name__ == "__main__":
    main()
