"""ModelRunner: a model plus its static HybridState, with the two compute paths every engine uses.

    prefill(slot, ids)      wide kernels over the prompt; sets position, next_token, hidden
    rows(slot, tokens)      n <= W decode-time rows at fixed width W (AR step: n=1, verify: n=K+1)

Rows computed at width W are bitwise independent of n (see baton/models/qwen3_5.py), which is what
makes verification and MTP speculation exact. The decode worker replays `rows` from CUDA graphs
(decode_worker/graph.py); this class is the eager reference and the CPU path.
"""
from __future__ import annotations

import torch

from baton.config import ModelConfig
from baton.models.qwen3_5 import Qwen3_5ForCausalLM, StepContext
from baton.state import HybridState

DEFAULT_WIDTH = 16


class WindowError(ValueError):
    """A request does not fit the engine's window (prompt + new tokens + speculation rows)."""


class ModelRunner:
    def __init__(self, model: Qwen3_5ForCausalLM, *, slots: int = 1, max_len: int = 4096,
                 width: int = DEFAULT_WIDTH, dtype: torch.dtype | None = None):
        p = next(model.parameters())
        self.model, self.cfg = model, model.cfg
        self.device, self.dtype = p.device, dtype or p.dtype
        self.width, self.max_len = width, max_len
        self.has_mtp = hasattr(model, "mtp")
        self.state = HybridState(self.cfg, slots=slots, max_len=max_len, dtype=self.dtype, device=self.device,
                                 mtp=self.has_mtp)

    @property
    def cfg_(self) -> ModelConfig:
        return self.cfg

    def check_window(self, prompt_len: int, new_tokens: int, extra_rows: int = 0) -> None:
        need = prompt_len + new_tokens + extra_rows
        if need > self.max_len:
            raise WindowError(f"prompt ({prompt_len}) + max_new_tokens ({new_tokens})"
                              + (f" + speculation rows ({extra_rows})" if extra_rows else "")
                              + f" = {need} exceeds the window of {self.max_len} tokens")

    def check_ids(self, ids, field: str = "prompt") -> None:
        bad = [t for t in ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"{field}: token id {bad[0]} out of range [0, {self.cfg.vocab_size})")

    # ---- prefill -------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, slot: int, ids: list[int], start: int = 0) -> int:
        """Consumes ids at positions [start, start+T); returns the greedy next token."""
        if not ids:
            raise ValueError("prompt: empty")
        self.check_window(start + len(ids), 0)
        if start == 0:
            self.state.reset(slot)
        x = torch.tensor(ids, dtype=torch.long, device=self.device)
        h = self.model(x, self.state, StepContext(slot=slot, width=None, n=len(ids), start=start))
        tok = int(self.model.logits(h[-1:]).argmax(-1))
        if self.has_mtp:   # MTP KV for the pairs (h_t, x_{t+1}), t in [start, start+T)
            nxt = torch.cat([x[1:], torch.tensor([tok], device=self.device)])
            pos = torch.arange(start, start + len(ids), device=self.device)
            self.model.mtp(self.model.model.embed_tokens, h, nxt, pos, self.state,
                           StepContext(slot=slot, width=None, n=len(ids), start=start, rope_offset=1))
        s = self.state
        s.position[slot] = start + len(ids)
        s.next_token[slot] = tok
        s.hidden[slot].copy_(h[-1])
        return tok

    # ---- fixed-width rows ------------------------------------------------------------------------
    def pad_ids(self, tokens: list[int]) -> torch.Tensor:
        buf = torch.zeros(self.width, dtype=torch.long, device=self.device)
        buf[: len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return buf

    @torch.inference_mode()
    def rows_step(self, slot: int, ids_w: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ids_w [W] (first n valid) -> (greedy tokens [W], logits [W, vocab]); advances position by n,
        stores the hidden row n-1. Pure tensor code: this is what a CUDA graph captures."""
        h = self.model(ids_w, self.state, StepContext(slot=slot, width=self.width, n=n))
        logits = self.model.logits(h)                                      # [W, vocab]
        self.state.hidden[slot].copy_(h[n - 1])
        return logits.argmax(-1), logits

    @torch.inference_mode()
    def mtp_rows_step(self, slot: int, hidden_w: torch.Tensor, ids_w: torch.Tensor, start: torch.Tensor,
                      n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP head over n <= W pairs (hidden_w[i], ids_w[i]) at KV indexes start + i.
        hidden_w [W, h], ids_w [W], start [] int64 device -> (greedy drafts [W], normed out [W, h])."""
        pos = start + torch.arange(self.width, device=self.device)
        out = self.model.mtp(self.model.model.embed_tokens, hidden_w, ids_w, pos, self.state,
                             StepContext(slot=slot, width=self.width, n=n, rope_offset=1))
        return self.model.logits(out).argmax(-1), out

    def rows(self, slot: int, tokens: list[int]) -> list[int]:
        """Feeds tokens (1 <= n <= W) and returns the greedy token after each of them."""
        n = len(tokens)
        if not 1 <= n <= self.width:
            raise ValueError(f"rows: {n} tokens, expected 1..{self.width}")
        pos = int(self.state.position[slot])
        self.check_window(pos, n)
        out, _ = self.rows_step(slot, self.pad_ids(tokens), n)
        return out[:n].tolist()
