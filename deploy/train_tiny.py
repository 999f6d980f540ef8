"""Train Baton's tiny default model: a Qwen3.5-text hybrid (GDN + full attention) with an MTP head.

    python deploy/train_tiny.py --out DIR [--minutes 6] [--device cuda] [--seed 0] [--smoke]

Corpus and tokenizer: deploy/tiny_corpus.py (CPython stdlib `.py` files, byte-level BPE).
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
import copy
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
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_corpus  # noqa: E402  (deploy/tiny_corpus.py)

SIZE_LIMIT = 16_000_000  # bytes, model.safetensors + mtp.safetensors


def model_config(vocab: int, eos_id: int, hidden=256, layers=8, intermediate=448):
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=eos_id, bos_token_id=None,
        pad_token_id=None, mtp_num_hidden_layers=1, initializer_range=0.02,
    )
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.dtype = torch.bfloat16  # what the checkpoint stores
    return cfg


class MTPHead(nn.Module):
    """The checkpoint's `mtp.*` module; parameter names match Baton's `baton/models/mtp.py`."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
        H, eps = config.hidden_size, config.rms_norm_eps
        layer_cfg = copy.deepcopy(config)  # only layer_types[0] and the sizes are read by the layer
        layer_cfg.layer_types = ["full_attention"] * config.num_hidden_layers
        layer_cfg._attn_implementation = "sdpa"  # causal via is_causal when attention_mask is None
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_cfg, 0)])
        self.norm = Qwen3_5RMSNorm(H, eps=eps)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=config.initializer_range)

    def forward(self, hidden, emb, positions, rotary_emb):
        """hidden, emb: [B, L, H]; positions: [L] RoPE positions. Returns mtp.norm(u): [B, L, H]."""
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        # the text rotary embedding takes (3, B, L) ids (mrope layout; all three equal for text)
        pos_emb = rotary_emb(u, positions.view(1, 1, -1).expand(3, 1, -1))
        u = self.layers[0](u, position_embeddings=pos_emb, attention_mask=None, position_ids=positions.view(1, -1))
        return self.norm(u[0] if isinstance(u, tuple) else u)


def mtp_chain(model, mtp, ids, h, steps):
    """ids: [B, T+1]; h: [B, T] final-normed hidden of ids[:, :T]. Step k (1-based) returns logits
    [B, T-k, V]; index t predicts ids[:, t+k+1] (targets ids[:, k+1:]). Main-model tensors are detached."""
    W = model.get_input_embeddings().weight.detach()
    T = h.shape[1]
    prev, out = h.detach(), []
    for k in range(1, steps + 1):
        n = T - k
        if n <= 0:
            break
        pos = torch.arange(k, T, device=ids.device)
        prev = mtp(prev[:, :n], F.embedding(ids[:, k:T], W), pos, model.model.rotary_emb)
        out.append(F.linear(prev, W))
    return out


def losses(model, mtp, x, steps, w1):
    T = x.shape[1] - 1
    h = model.model(input_ids=x[:, :T]).last_hidden_state
    logits = model.lm_head(h)
    main = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
    mtp_ce = [F.cross_entropy(lg.float().flatten(0, 1), x[:, k + 1:].flatten())
              for k, lg in enumerate(mtp_chain(model, mtp, x, h, steps), 1)]
    total = main + sum(w1 / 2 ** i * ce for i, ce in enumerate(mtp_ce))
    return total, main, mtp_ce


@torch.no_grad()
def evaluate(model, mtp, stream, T, steps, autocast, batch=16):
    """Non-overlapping windows of T+1 tokens over `stream` (1-D LongTensor on the model's device)."""
    n_win = (stream.numel() - 1) // T
    acc = {"n": 0, "ce": 0.0, "top1": 0, "mtp_n": [0] * steps, "mtp_ce": [0.0] * steps,
           "mtp_top1": [0] * steps, "agree": 0}
    for i in range(0, n_win, batch):
        x = torch.stack([stream[j * T: j * T + T + 1] for j in range(i, min(i + batch, n_win))])
        with autocast():
            h = model.model(input_ids=x[:, :T]).last_hidden_state
            logits = model.lm_head(h).float()
            chain = [lg.float() for lg in mtp_chain(model, mtp, x, h, steps)]
        pred = logits.argmax(-1)
        acc["n"] += pred.numel()
        acc["ce"] += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        acc["top1"] += (pred == x[:, 1:]).sum().item()
        for k, lg in enumerate(chain, 1):
            tgt = x[:, k + 1:]
            acc["mtp_n"][k - 1] += tgt.numel()
            acc["mtp_ce"][k - 1] += F.cross_entropy(lg.flatten(0, 1), tgt.flatten(), reduction="sum").item()
            acc["mtp_top1"][k - 1] += (lg.argmax(-1) == tgt).sum().item()
            if k == 1:  # would the main model (greedy, given x_{t+1}) emit the MTP draft for x_{t+2}?
                acc["agree"] += (lg.argmax(-1) == pred[:, 1:]).sum().item()
    loss = acc["ce"] / acc["n"]
    return {
        "tokens": acc["n"], "next_token_loss": loss, "perplexity": math.exp(loss),
        "next_token_top1": acc["top1"] / acc["n"],
        "mtp_loss": acc["mtp_ce"][0] / acc["mtp_n"][0], "mtp_top1": acc["mtp_top1"][0] / acc["mtp_n"][0],
        "mtp_agrees_with_main_top1": acc["agree"] / acc["mtp_n"][0],
        "mtp_chain_top1": [c / max(n, 1) for c, n in zip(acc["mtp_top1"], acc["mtp_n"])],
    }


@torch.no_grad()
def greedy(model, prompts, n_new, autocast):
    x = prompts
    for _ in range(n_new):
        with autocast():
            h = model.model(input_ids=x).last_hidden_state[:, -1:]
            nxt = model.lm_head(h).float().argmax(-1)
        x = torch.cat([x, nxt], dim=1)
    return x


@torch.no_grad()
def acceptance_estimate(model, mtp, seqs, prompt_len, K, autocast):
    """Greedy MTP speculation replayed on the model's own greedy text: per round the main model commits
    one token and the K chained drafts are accepted while they equal the greedy continuation."""
    with autocast():
        h = model.model(input_ids=seqs[:, :-1]).last_hidden_state
        drafts = [lg.argmax(-1).tolist() for lg in mtp_chain(model, mtp, seqs, h, K)]
    seqs = seqs.tolist()
    L, rounds, tokens = len(seqs[0]), 0, 0
    for b in range(len(seqs)):
        p = prompt_len - 1
        while p < L - 1 - K:
            a = 0
            while a < K and drafts[a][b][p] == seqs[b][p + 2 + a]:
                a += 1
            rounds, tokens, p = rounds + 1, tokens + 1 + a, p + 1 + a
    return {"K": K, "rounds": rounds, "tokens_per_round": tokens / max(rounds, 1)}


@torch.no_grad()
def check_mtp_causal(model, mtp, device, T=24, j=13):
    """Changing the MTP inputs at index j must leave outputs at indices < j unchanged (and change j)."""
    g = torch.Generator().manual_seed(1)
    H = model.config.hidden_size
    hid, emb = torch.randn(2, 1, T, H, generator=g).to(device).unbind(0)
    pos = torch.arange(1, T + 1, device=device)
    a = mtp(hid, emb, pos, model.model.rotary_emb).float()
    hid2 = hid.clone()
    hid2[:, j] += 3.0
    b = mtp(hid2, emb, pos, model.model.rotary_emb).float()
    ok = torch.allclose(a[:, :j], b[:, :j], atol=1e-5) and not torch.allclose(a[:, j:], b[:, j:], atol=1e-3)
    if not ok:
        raise RuntimeError("MTP layer attention is not causal")


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
    want, _ = ref(q.detach().float(), k.detach().float(), v.detach().float(), g=decay, beta=beta.float(),
                  use_qk_l2norm_in_kernel=True)
    err = ((out.detach().float() - want.float()).abs().max() / want.abs().max()).item()
    if not (math.isfinite(err) and err < 0.05) or not all(torch.isfinite(t.grad).all() for t in (q, k, v)):
        raise RuntimeError(f"GDN kernel disagrees with the torch reference (relative error {err:.3g})")
    return err


def param_count(module):
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def save_checkpoint(out: Path, config, model, mtp):
    from safetensors.torch import save_file
    sd = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()
          if not (config.tie_word_embeddings and k == "lm_head.weight")}
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
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if dev.type == "cuda"
                else contextlib.nullcontext)
    log = lambda msg: print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)  # noqa: E731
    if fla and dev.type == "cuda":  # a broken kernel install must not cost the whole run
        try:
            log(f"fla GDN kernel vs torch reference: relative error {preflight_gdn_kernel(dev):.2e}")
        except Exception as e:  # noqa: BLE001
            log(f"fla kernel check failed ({type(e).__name__}: {e}); restarting with --no-fla")
            os.execv(sys.executable, [sys.executable, *sys.argv, "--no-fla"])

    corpus = tiny_corpus.load_corpus(max_train_bytes=1_500_000 if args.smoke else None)
    log(f"corpus {json.dumps(corpus.stats())}")
    tok = tiny_corpus.train_tokenizer([t for _, t in corpus.train], args.vocab)
    tok.save(str(out / "tokenizer.json"))
    eos = tok.token_to_id(tiny_corpus.EOS)
    streams = {s: torch.from_numpy(tiny_corpus.encode_stream(tok, getattr(corpus, s), cap)).to(dev, torch.long)
               for s, cap in (("train", None), ("val", args.eval_tokens // 3), ("test", args.eval_tokens))}
    log(f"tokenizer vocab={tok.get_vocab_size()} eos={eos}; tokens " +
        " ".join(f"{s}={v.numel()}" for s, v in streams.items()))

    config = model_config(tok.get_vocab_size(), eos, intermediate=args.intermediate)
    model = Qwen3_5ForCausalLM(config).to(dev)
    mtp = MTPHead(config).to(dev)
    n_main, n_mtp = param_count(model), param_count(mtp)
    if 2 * (n_main + n_mtp) > SIZE_LIMIT:
        raise SystemExit(f"model too large: {n_main}+{n_mtp} params > {SIZE_LIMIT} bytes in BF16")
    check_mtp_causal(model, mtp, dev)
    log(f"params main={n_main} mtp={n_mtp}; fla={fla}; device={dev} "
        f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else platform.processor()}")

    params = list(model.named_parameters()) + [(f"mtp.{n}", p) for n, p in mtp.named_parameters()]
    decay = [p for n, p in params if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in params if not (p.ndim >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
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
            rec = {"step": step, "loss": loss.item(), "main": main_ce.item(), "mtp": [c.item() for c in mtp_ce],
                   "lr": lr_at(step - 1), "elapsed_s": round(time.time() - t0, 2),
                   "tok_per_s": round(step * B * T / (time.time() - t0))}
            history.append(rec)
            log(f"step {step}/{total} loss {rec['main']:.4f} mtp {' '.join(f'{c:.3f}' for c in rec['mtp'])} "
                f"lr {rec['lr']:.2e} {rec['tok_per_s']} tok/s")
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
    prompts = tiny_corpus.prompts(tok, corpus.test, P, 2 if args.smoke else 8)
    seqs = greedy(model, torch.tensor(prompts, device=dev), n_new, autocast)
    accept = acceptance_estimate(model, mtp, seqs, P, K, autocast)
    log(f"held-out {json.dumps(test)}; acceptance estimate {json.dumps(accept)}")
    info = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "fla": fla, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "seed": args.seed, "smoke": args.smoke, "corpus": corpus.stats(),
        "tokens": {s: v.numel() for s, v in streams.items()}, "vocab_size": tok.get_vocab_size(),
        "params": {"main": n_main, "mtp": n_mtp, "total": n_main + n_mtp},
        "train": {"steps": step, "batch": B, "seq_len": T, "tokens_seen": step * B * T, "seconds": round(train_s, 1),
                  "lr": args.lr, "warmup": warmup, "mtp_weight": args.mtp_weight, "mtp_steps": args.mtp_steps,
                  "best_step": best[1], "history": history, "val": vals},
        "heldout": test, "acceptance_estimate": accept,
        "samples": [tiny_corpus.sample_text(tok, s, P, eos) for s in seqs.tolist()[:3]], "samples_new_tokens": n_new,
        "total_seconds": round(time.time() - t_start, 1),
    }
    (out / "train_log.json").write_text(json.dumps(info, indent=1) + "\n")
    (out / "README.md").write_text(tiny_corpus.model_card(info, config))
    log(f"wrote {out}: " + ", ".join(sorted(f.name for f in out.iterdir())))


if __name__ == "__main__":
    main()
