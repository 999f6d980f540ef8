"""`baton make-tiny`: write a random-weight Qwen3.5 checkpoint (tiny shapes, for tests) in seconds on CPU.

The weights come from transformers' own `Qwen3_5ForCausalLM`, re-initialised with a seeded generator
so every tensor is non-trivial (HF init zeroes the zero-centred norms and sets dt_bias to ones; here the
GDN decay gives the recurrent state a memory of tens of tokens, see `_randomize`).
The directory holds what a real Qwen3.5 checkpoint holds:
    config.json, generation_config.json    (model_type qwen3_5_text, or qwen3_5 with text_config)
    model.safetensors                      (or model.safetensors.index.json + 2 shards)
    mtp.safetensors                        (MTP head sidecar; or merged into the main files)
    tokenizer.json, tokenizer_config.json  (byte-level BPE trained on a built-in text)
Same arguments -> same bytes (transformers version string aside).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

EOS_TOKEN = "<|endoftext|>"
LOGIT_GAIN = 4.0  # embed/lm_head std = LOGIT_GAIN/sqrt(hidden): logits std ~ LOGIT_GAIN, few near-ties
QKV_GAIN = 3.0  # larger GDN values keep the gated norm's input far above its eps (fp32 parity)
NOISE = 0.1  # std of the noise added to the other 1-D parameters (the norms)

# Tokenizer training text: enough distinct words for several hundred merges.
_CORPUS = '''
import json
import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int = 16
    temperature: float = 0.0
    stop: tuple[int, ...] = field(default_factory=tuple)


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


class Counter:
    """Count how often each token appears in a stream of requests."""

    def __init__(self, vocab_size: int) -> None:
        self.counts = [0] * vocab_size
        self.seen = 0

    def update(self, tokens: list[int]) -> None:
        for token in tokens:
            if token < 0 or token >= len(self.counts):
                raise ValueError(f"token {token} out of range")
            self.counts[token] += 1
        self.seen += len(tokens)

    def most_common(self, n: int = 10) -> list[tuple[int, int]]:
        pairs = sorted(enumerate(self.counts), key=lambda p: p[1], reverse=True)
        return pairs[:n]


def read_config(path: Path) -> dict:
    with open(path, "r", encoding="utf-8") as f:
        data = json.load(f)
    if "hidden_size" not in data:
        raise KeyError("hidden_size")
    return data


async def generate(model, request: Request):
    state = model.prefill(request.prompt)
    for step in range(request.max_new_tokens):
        token = state.next_token()
        if token in request.stop:
            break
        yield token
    print("done after", step, "steps")


def main(argv=None) -> int:
    args = parse_args(argv)
    while args.retries > 0:
        try:
            return run(args)
        except (OSError, TimeoutError) as err:
            print("retrying:", err)
            args.retries -= 1
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
'''


def _layer_types(layers: int) -> list[str]:
    # layer i is full attention when (i+1) % 4 == 0; a model with <4 layers gets its last layer full.
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    if layers >= 1 and "full_attention" not in types:
        types[-1] = "full_attention"
    return types


def _train_tokenizer(vocab: int):
    """Byte-level BPE with `vocab` tokens (fewer if the corpus runs out of merges); EOS is the last id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab - 1, 256), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    tok.add_special_tokens([EOS_TOKEN])
    return tok


@torch.no_grad()
def _randomize(named: list[tuple[str, torch.Tensor]], gen: torch.Generator, hidden: int) -> None:
    """In place: matrices ~ N(0, 1/fan_in) (embed/lm_head scaled by LOGIT_GAIN); GDN decay parameters as
    below; other 1-D params += noise."""
    for name, p in named:
        # GDN decay per token is exp(-A * softplus(a_t + dt_bias)), a_t ~ N(0, 1) here.
        if name.endswith("A_log"):
            # A in [0.3, 1.5] rather than HF's U(0.01, 16): no head forgets everything every token.
            p.copy_(torch.empty(p.shape).uniform_(0.3, 1.5, generator=gen).log())
        elif name.endswith("dt_bias"):
            # Mamba-2 / FLA style: dt_bias = softplus^-1(dt), dt ~ logU(1e-3, 1e-1), so the median decay is
            # ~0.99 per token (5% below 0.86) and the state S [dk, dv] holds many tokens. HF's dt_bias = 1
            # gives a median decay ~0.3 even with these A: S is ~rank 1, o = S^T q is ~(q.k_last) v_last, and where q is nearly
            # orthogonal to k_last (for every GVA head sharing that key head at once) the head output sinks
            # below the gated norm's sqrt(eps); fp32 rounding in q.k then moves logits by ~1e-3, in HF's own
            # fp32 model as in Baton's (measured against fp64), and 1e-4 parity becomes impossible.
            dt = torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif p.dim() == 1:
            p.add_(torch.randn(p.shape, generator=gen) * NOISE)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            p.copy_(torch.randn(p.shape, generator=gen) * (LOGIT_GAIN / math.sqrt(hidden)))
        else:  # Linear [out, in] / conv1d [C, 1, K]: fan_in is the last dim
            gain = QKV_GAIN if name.endswith("in_proj_qkv.weight") else 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * (gain / math.sqrt(p.shape[-1])))


def _mtp_tensors(state: dict, layer_types: list[str], hidden: int, gen, dtype) -> dict:
    """mtp.* tensors: fc [H, 2H], three zero-centred norms [H], and layer 0 shaped like a full-attn layer."""
    j = layer_types.index("full_attention")
    prefix = f"model.layers.{j}."
    out = {
        "mtp.fc.weight": torch.empty(hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(hidden),
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(hidden),
        "mtp.norm.weight": torch.zeros(hidden),
    }
    for name, t in state.items():
        if name.startswith(prefix):
            out["mtp.layers.0." + name[len(prefix) :]] = torch.zeros(t.shape)
    _randomize(sorted(out.items()), gen, hidden)
    return {k: v.to(dtype).contiguous() for k, v in sorted(out.items())}


def _post_process(out: Path, *, mtp: dict, mtp_inline: bool, shards: int, multimodal: bool) -> None:
    """Rewrite the HF-saved files into the multimodal / merged-MTP / sharded layouts."""
    from safetensors.torch import load_file, save_file

    meta = {"format": "pt"}
    main = out / "model.safetensors"
    tensors = load_file(str(main))
    if multimodal:
        tensors = {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in tensors.items()}
        tensors["model.visual.blocks.0.x.weight"] = torch.ones(4, 4, dtype=next(iter(tensors.values())).dtype)
        cfg_path = out / "config.json"
        text = json.loads(cfg_path.read_text())
        text.pop("architectures", None)
        wrapper = {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "text_config": text,
            "vision_config": {"model_type": "qwen3_5_vision", "depth": 1},
            "tie_word_embeddings": text.get("tie_word_embeddings", False),
            "transformers_version": text.get("transformers_version"),
        }
        cfg_path.write_text(json.dumps(wrapper, indent=2, sort_keys=True) + "\n")
    if mtp_inline:
        tensors.update(mtp)
    elif mtp:
        save_file(mtp, str(out / "mtp.safetensors"), metadata=meta)
    main.unlink()
    if shards <= 1:
        save_file(tensors, str(main), metadata=meta)
        return
    names = sorted(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per : (s + 1) * per]}
        save_file(part, str(out / fname), metadata=meta)
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def make_random_checkpoint(
    out_dir,
    *,
    seed: int = 0,
    layers: int = 4,
    hidden: int = 64,
    vocab: int = 512,
    mtp: bool = True,
    tie: bool = False,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    linear_heads: tuple[int, int] = (2, 4),
    linear_head_dim: int = 16,
    intermediate: int | None = None,
    conv_kernel: int = 4,
    dtype: str | torch.dtype = "float32",
    shards: int = 1,
    multimodal: bool = False,
    mtp_inline: bool = False,
) -> Path:
    """Write a tiny Qwen3.5 checkpoint to `out_dir` and return its path.

    linear_heads = (k_heads, v_heads) of the Gated DeltaNet layers. mtp_inline puts the mtp.* tensors in
    the main safetensors file(s) (and index) instead of the `mtp.safetensors` sidecar.
    """
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(vocab)
    eos = tok.token_to_id(EOS_TOKEN)
    types = _layer_types(layers)
    config = Qwen3_5TextConfig(
        vocab_size=max(vocab, tok.get_vocab_size()),
        hidden_size=hidden,
        intermediate_size=intermediate or 3 * hidden,
        num_hidden_layers=layers,
        layer_types=types,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        linear_num_key_heads=linear_heads[0],
        linear_num_value_heads=linear_heads[1],
        linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim,
        linear_conv_kernel_dim=conv_kernel,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        eos_token_id=eos,
    )
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).float().eval()
    _randomize(list(model.named_parameters()), gen, hidden)  # tied lm_head is yielded once
    model = model.to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    mtp_t = _mtp_tensors(model.state_dict(), types, hidden, gen, dtype) if mtp else {}

    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["mtp_num_hidden_layers"] = 1 if mtp else 0
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "model_max_length": 4096}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    _post_process(out, mtp=mtp_t, mtp_inline=mtp_inline, shards=shards, multimodal=multimodal)
    return out


# ---- CLI -----------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", metavar="DIR", help="directory to write the checkpoint into")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default %(default)s)")
    p.add_argument(
        "--layers", type=int, default=4, help="decoder layers, every 4th full attention (default %(default)s)"
    )
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default %(default)s)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size (default %(default)s)")
    p.add_argument("--no-mtp", dest="mtp", action="store_false", help="do not write mtp.safetensors")
    p.add_argument("--tie", action="store_true", help="tie lm_head to the embeddings")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="stored dtype (default %(default)s)"
    )
    p.add_argument("--shards", type=int, default=1, help="write N shards + model.safetensors.index.json")
    p.add_argument("--multimodal", action="store_true", help="qwen3_5 wrapper config, model.language_model.*")


def run(args: argparse.Namespace) -> int:
    path = make_random_checkpoint(
        args.out_dir,
        seed=args.seed,
        layers=args.layers,
        hidden=args.hidden,
        vocab=args.vocab,
        mtp=args.mtp,
        tie=args.tie,
        dtype=args.dtype,
        shards=args.shards,
        multimodal=args.multimodal,
    )
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="baton make-tiny", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
