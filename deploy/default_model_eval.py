"""Evaluation helpers of deploy/train_default_model.py: held-out loss, greedy continuations, a speculation
acceptance estimate, and the MTP head's causality check."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from default_model_arch import losses, mtp_chain  # noqa: F401  (deploy/default_model_arch.py)


@torch.no_grad()
def evaluate(model, mtp, stream, T, steps, autocast, batch=16):
    """Non-overlapping windows of T+1 tokens over `stream` (1-D LongTensor on the model's device)."""
    n_win = (stream.numel() - 1) // T
    acc = {
        "n": 0,
        "ce": 0.0,
        "top1": 0,
        "mtp_n": [0] * steps,
        "mtp_ce": [0.0] * steps,
        "mtp_top1": [0] * steps,
        "agree": 0,
    }
    for i in range(0, n_win, batch):
        x = torch.stack([stream[j * T : j * T + T + 1] for j in range(i, min(i + batch, n_win))])
        with autocast():
            h = model.model(input_ids=x[:, :T]).last_hidden_state
            logits = model.lm_head(h).float()
            chain = [lg.float() for lg in mtp_chain(model, mtp, x, h, steps)]
        pred = logits.argmax(-1)
        acc["n"] += pred.numel()
        acc["ce"] += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        acc["top1"] += (pred == x[:, 1:]).sum().item()
        for k, lg in enumerate(chain, 1):
            tgt = x[:, k + 1 :]
            acc["mtp_n"][k - 1] += tgt.numel()
            acc["mtp_ce"][k - 1] += F.cross_entropy(lg.flatten(0, 1), tgt.flatten(), reduction="sum").item()
            acc["mtp_top1"][k - 1] += (lg.argmax(-1) == tgt).sum().item()
            if k == 1:  # would the main model (greedy, given x_{t+1}) emit the MTP draft for x_{t+2}?
                acc["agree"] += (lg.argmax(-1) == pred[:, 1:]).sum().item()
    loss = acc["ce"] / acc["n"]
    return {
        "tokens": acc["n"],
        "next_token_loss": loss,
        "perplexity": math.exp(loss),
        "next_token_top1": acc["top1"] / acc["n"],
        "mtp_loss": acc["mtp_ce"][0] / acc["mtp_n"][0],
        "mtp_top1": acc["mtp_top1"][0] / acc["mtp_n"][0],
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
