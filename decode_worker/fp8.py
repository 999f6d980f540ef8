"""FP8 (e4m3, per-output-row scale) weights for the decode worker.

    FP8Linear.from_linear(linear)   weight [out, in] float8_e4m3fn, scale [out] fp32 (amax / 448)
    FP8Linear.forward(x [M, in])    W8A8: x rows quantised to e4m3 per group of 128 columns in the GEMM
                                    CUDA + triton: the rows kernel (baton/kernels/gemv.py)
                                    otherwise: w8a8_reference, the same arithmetic in torch fp32
    quantize_model(model, mode)     "full": every decoder-layer projection plus the LM head (the tiny
                                    GDN in_proj_b / in_proj_a too: fp8 lets them ride in the merged
                                    qkv|z|b|a GEMM instead of a launch of their own per layer);
                                    "tail" (state-safe tail): only the last layer's MLP plus the LM
                                    head, so GDN / attention state stays bitwise the BF16 trajectory
    quantize_head(model)            sets `model.fp8_head` (works for a tied or an untied head)

NOTE: the model's `logits()` must use `model.fp8_head` when present:
    head = getattr(self, "fp8_head", None)
    return head(hidden) if head is not None else F.linear(hidden, self.head_weight())
The BF16 head weight stays in place (a tied head is also the embedding); fp8_head is a copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:
    from baton.kernels import gemv
except Exception:  # triton missing or broken: CPU / reference path only
    gemv = None

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_GROUP = 128  # activation quantisation group (== baton.kernels.gemv.FP8_GROUP)
_QUANT_ROWS = 4096  # rows per quantisation chunk (bounds the fp32 temporary)


@torch.no_grad()
def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (w_fp8 [N, K] e4m3, scale [N] fp32), w ~= w_fp8 * scale[:, None]."""
    N, K = w.shape
    q = torch.empty(N, K, dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(N, dtype=torch.float32, device=w.device)
    for r0 in range(0, N, _QUANT_ROWS):
        wf = w[r0 : r0 + _QUANT_ROWS].float()  # [n, K]
        amax = wf.abs().amax(dim=1)  # [n]
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # zero row -> scale 1
        q[r0 : r0 + _QUANT_ROWS] = (wf / s[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scale[r0 : r0 + _QUANT_ROWS] = s
    return q, scale


@torch.no_grad()
def w8a8_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, group: int = FP8_GROUP) -> torch.Tensor:
    """The W8A8 arithmetic of baton/kernels/gemv.py in torch fp32: each x row is quantised to e4m3 per
    `group` columns (sx = amax / 448), y[m, n] = sum_g (xq_g . w_g) * sx[m, g] * scale[n].
    x [M, K], w [N, K] e4m3, scale [N] -> [M, N] fp32."""
    M, K = x.shape
    G = -(-K // group)
    xf = F.pad(x.float(), (0, G * group - K)).view(M, G, group)  # [M, G, g]
    wf = F.pad(w.float(), (0, G * group - K)).view(w.shape[0], G, group)  # [N, G, g]
    amax = xf.abs().amax(-1).clamp_min(1e-30)  # [M, G]
    xq = (xf * (FP8_MAX / amax)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    part = torch.einsum("mgk,ngk->mgn", xq, wf)  # [M, G, N]
    return (part * (amax / FP8_MAX)[..., None]).sum(1) * scale.float()


class FP8Linear(nn.Module):
    """Bias-free linear with e4m3 weights and per-output-row fp32 scales."""

    use_kernel = True  # class switch: False forces the dequantise + F.linear path everywhere

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        assert weight.dtype == FP8_DTYPE and weight.dim() == 2, (weight.dtype, weight.shape)
        assert scale.dtype == torch.float32 and scale.shape == weight.shape[:1], (scale.dtype, scale.shape)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight.contiguous())  # [out, in] e4m3
        self.register_buffer("scale", scale.contiguous())  # [out] fp32

    @classmethod
    def from_weight(cls, w: torch.Tensor) -> "FP8Linear":
        return cls(*quantize_rows(w.detach()))

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "FP8Linear":
        if linear.bias is not None:
            raise ValueError("FP8Linear: biased Linear layers are not supported")
        return cls.from_weight(linear.weight)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype) * self.scale[:, None].to(dtype)  # [out, in]

    def _apply(self, fn, recurse=True):
        # NOTE: model.to(dtype) / .half() / .bfloat16() must not cast the e4m3 weight or the fp32
        # scales (torch treats float8 as floating point); only device moves apply to them.
        for name in ("weight", "scale"):
            t = self._buffers[name]
            dev = fn(torch.empty(0, dtype=t.dtype, device=t.device)).device
            if dev != t.device:
                self._buffers[name] = t.to(dev)
        return self

    def forward(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """x [..., in] bf16/fp16/fp32 -> [..., out] in x.dtype; W8A8 (x quantised per row and group of
        gemv.FP8_GROUP columns). `rows`: only the first rows of x (flattened) are live; the rest of
        the output is 0 (kernel) or computed (reference), never to be read."""
        if self.use_kernel and x.is_cuda and gemv is not None:
            return gemv.linear(x, self.weight, self.scale, rows=rows)
        y = w8a8_reference(x.reshape(-1, self.in_features), self.weight, self.scale, FP8_GROUP)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-row scale"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _swap(parent: nn.Module, name: str, stats: dict, prefix: str) -> None:
    lin = getattr(parent, name)
    fp8 = FP8Linear.from_linear(lin)
    setattr(parent, name, fp8)
    stats["modules"].append(prefix + name)
    stats["bytes_before"] += _nbytes(lin.weight)
    stats["bytes_after"] += _nbytes(fp8.weight) + _nbytes(fp8.scale)


def quantize_head(model: nn.Module) -> FP8Linear:
    """model.fp8_head = FP8 copy of the LM head (tied: of the embedding). Returns it."""
    model.fp8_head = FP8Linear.from_weight(model.head_weight())
    return model.fp8_head


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str = "full") -> dict:
    """Replaces decoder-layer nn.Linear modules by FP8Linear in place and adds model.fp8_head.

    Returns {"mode", "replaced", "modules", "bytes_before", "bytes_after",
             "head_bytes_before", "head_bytes_after"}; bytes count the replaced weights only.
    """
    if mode not in ("full", "tail"):
        raise ValueError(f"mode: {mode!r}, expected 'full' or 'tail'")
    layers = model.model.layers
    stats = {"mode": mode, "modules": [], "bytes_before": 0, "bytes_after": 0}
    if mode == "full":
        targets = [(f"model.layers.{i}.", layer) for i, layer in enumerate(layers)]
    else:  # state-safe tail: the last MLP only; its output feeds the final norm and head, no state
        targets = [(f"model.layers.{len(layers) - 1}.mlp.", layers[-1].mlp)]
    for prefix, root in targets:
        linears = [(n, m) for n, m in root.named_modules() if type(m) is nn.Linear]
        for qual, _ in linears:
            parent_name, _, name = qual.rpartition(".")
            parent = root.get_submodule(parent_name) if parent_name else root
            _swap(parent, name, stats, prefix + (parent_name + "." if parent_name else ""))
    head = quantize_head(model)
    stats["head_bytes_before"] = _nbytes(model.head_weight())
    stats["head_bytes_after"] = _nbytes(head.weight) + _nbytes(head.scale)
    stats["replaced"] = len(stats["modules"])
    return stats
