"""The Qwen3.5 MTP draft head (checkpoint names `mtp.*`).

For the pair (h_t, x_{t+1}) — h_t the main model's final-normed hidden row at position t, x_{t+1}
the token that follows — it predicts x_{t+2}:
    u = fc(cat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])   # [T, hidden]
    u = layers.0(u)        # full-attention decoder layer; KV index t, RoPE position t+1
    out = norm(u)          # logits = lm_head(out); out is also the h for a chained next step
The layer keeps its own KV in HybridState under index cfg.num_hidden_layers (`state.mtp_layer`).
"""

from __future__ import annotations

import torch
from torch import nn

from baton.config import ModelConfig
from baton.models.qwen3_5 import DecoderLayer, RMSNorm, StepContext, lin


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, cfg.num_hidden_layers)])

    def forward(
        self, embed: nn.Embedding, hidden: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, state, ctx: StepContext
    ) -> torch.Tensor:
        """hidden [T, h] (h_t rows), ids [T] (x_{t+1}), pos [T] KV indexes t -> normed out [T, h].
        ctx.rope_offset must be 1; ctx.width/n as for the main model (rows mode writes n rows)."""

        def fc(e, h):  # per row
            return lin(self.fc, torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(h)], dim=-1))

        u = self.layers[0](ctx.map(fc, embed(ids), hidden), pos, state, ctx)
        return ctx.map(self.norm, u)
