"""The default model's architecture and losses (deploy/train_default_model.py): Qwen3.5 text config, the MTP head
in the checkpoint's own naming, the chained MTP forward, and the training losses."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


def model_config(vocab: int, eos_id: int, hidden=256, layers=8, intermediate=448):
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=None,
        mtp_num_hidden_layers=1,
        initializer_range=0.02,
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
    mtp_ce = [
        F.cross_entropy(lg.float().flatten(0, 1), x[:, k + 1 :].flatten())
        for k, lg in enumerate(mtp_chain(model, mtp, x, h, steps), 1)
    ]
    total = main + sum(w1 / 2**i * ce for i, ce in enumerate(mtp_ce))
    return total, main, mtp_ce
