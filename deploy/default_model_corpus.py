"""Corpus, tokenizer and model card of the embedded default model (used by deploy/train_default_model.py).

The corpus is the `.py` source of the standard library of the interpreter that runs the script, so
nothing is downloaded. Files are listed in sorted order; a file belongs to a split by a stable hash of
its path relative to the stdlib root:

    sha256(relpath) mod 20 == 0  -> "test"  (held out; every figure in the model card comes from it)
    sha256(relpath) mod 20 == 1  -> "val"   (held out; only used to pick the best checkpoint)
    otherwise                    -> "train" (tokenizer and model training)

Skipped: anything under site-packages / dist-packages, `pydoc_data/` (English prose in a string,
not code), and files that are not valid UTF-8 (a few deliberately broken test inputs). The `test/`
package is included when the interpreter ships it: it is ordinary Python and more data helps a model
that sees the corpus many times.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

EOS = "<|endoftext|>"
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "pydoc_data"}


@dataclass
class Corpus:
    root: str
    python_version: str
    train: list[tuple[str, str]] = field(default_factory=list)  # (relpath, text)
    val: list[tuple[str, str]] = field(default_factory=list)
    test: list[tuple[str, str]] = field(default_factory=list)
    skipped_non_utf8: int = 0

    def stats(self) -> dict:
        def n_bytes(docs):
            return sum(len(t.encode("utf-8")) for _, t in docs)

        return {
            "stdlib_root": self.root,
            "python_version": self.python_version,
            "files": {"train": len(self.train), "val": len(self.val), "test": len(self.test)},
            "bytes": {"train": n_bytes(self.train), "val": n_bytes(self.val), "test": n_bytes(self.test)},
            "skipped_non_utf8": self.skipped_non_utf8,
        }


def split_of(relpath: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big") % 20
    return "test" if bucket == 0 else "val" if bucket == 1 else "train"


def stdlib_files(root: Path) -> list[tuple[str, Path]]:
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]) or not p.is_file():
            continue
        out.append((rel.as_posix(), p))
    out.sort(key=lambda rp: rp[0])
    return out


def load_corpus(max_train_bytes: int | None = None) -> Corpus:
    """Read the stdlib corpus. `max_train_bytes` (smoke mode) caps the training split; held-out splits stay whole."""
    root = Path(sysconfig.get_paths()["stdlib"])
    corpus = Corpus(root=str(root), python_version=platform.python_version())
    train_bytes = 0
    for rel, path in stdlib_files(root):
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            corpus.skipped_non_utf8 += 1
            continue
        text = text.lstrip("\ufeff")
        if not text.strip():
            continue
        split = split_of(rel)
        if split == "train":
            if max_train_bytes is not None and train_bytes >= max_train_bytes:
                continue
            train_bytes += len(text)
        getattr(corpus, split).append((rel, text))
    if not corpus.train or not corpus.test:
        raise RuntimeError(f"stdlib corpus at {root} is too small: {corpus.stats()}")
    return corpus


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE; `<|endoftext|>` is id 0, used as EOS and as the document separator."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode_stream(tok, docs: list[tuple[str, str]], max_tokens: int | None = None):
    """Concatenate documents as `doc EOS doc EOS ...`: an int32 numpy array (cut at max_tokens if given)."""
    import numpy as np

    eos = np.array([tok.token_to_id(EOS)], dtype=np.int32)
    parts, n = [], 0
    batch = 512
    for i in range(0, len(docs), batch):
        for enc in tok.encode_batch([t for _, t in docs[i : i + batch]], add_special_tokens=False):
            parts += [np.asarray(enc.ids, dtype=np.int32), eos]
            n += len(enc.ids) + 1
        if max_tokens is not None and n >= max_tokens:
            break
    ids = np.concatenate(parts)
    return ids if max_tokens is None else ids[:max_tokens]


def prompts(tok, docs: list[tuple[str, str]], n_tokens: int, count: int) -> list[list[int]]:
    """Deterministic prompts from held-out files: `n_tokens` tokens starting at the file's first `def`."""
    out = []
    for _, text in docs:
        cut = min((i for i in (text.find("\ndef "), text.find("\n    def ")) if i >= 0), default=-1)
        ids = tok.encode(text[cut + 1 :], add_special_tokens=False).ids
        if len(ids) >= n_tokens + 8:
            out.append(ids[:n_tokens])
        if len(out) == count:
            break
    if not out:
        raise RuntimeError("no held-out file is long enough for a prompt")
    return out


def sample_text(tok, ids: list[int], prompt_len: int, eos: int) -> dict:
    cont = ids[prompt_len:]
    if eos in cont:
        cont = cont[: cont.index(eos)]
    return {"prompt": tok.decode(ids[:prompt_len]), "continuation": tok.decode(cont)}


def model_card(info: dict, config) -> str:
    h, tr, acc, c = info["heldout"], info["train"], info["acceptance_estimate"], info["corpus"]
    py = ".".join(info["python"].split(".")[:2])
    chain = ", ".join(f"step {k}: {v:.1%}" for k, v in enumerate(h["mtp_chain_top1"], 1))
    n_gdn = sum(t == "linear_attention" for t in config.layer_types)
    sample = info["samples"][0] if info["samples"] else {"prompt": "", "continuation": ""}
    smoke = "\n**SMOKE RUN** (CPU, a few steps): the figures below are meaningless.\n" if info["smoke"] else ""
    return f"""# baton-tiny: a Qwen3.5-architecture model of the Python standard library
{smoke}
Baton's embedded default model: a tiny hybrid recurrent model (Gated DeltaNet + full attention) with an
MTP draft head, trained from scratch on the `.py` files of the CPython {py} standard library by
`deploy/train_default_model.py`. It writes plausible-looking Python; it is a test and demo model, not a
useful assistant.

## Architecture
| | |
| --- | --- |
| model_type | `{config.model_type}` (`Qwen3_5ForCausalLM`), BF16 |
| layers | {config.num_hidden_layers}: {n_gdn} Gated DeltaNet, full attention at {[i for i, t in enumerate(config.layer_types) if t == "full_attention"]} |
| hidden / MLP | {config.hidden_size} / {config.intermediate_size} (SiLU gated) |
| full attention | {config.num_attention_heads} query heads, {config.num_key_value_heads} KV heads, head_dim {config.head_dim}, output gate, partial RoPE 0.25 |
| Gated DeltaNet | {config.linear_num_key_heads} key heads / {config.linear_num_value_heads} value heads, head dims {config.linear_key_head_dim}/{config.linear_value_head_dim}, conv kernel {config.linear_conv_kernel_dim} |
| vocabulary | {config.vocab_size} byte-level BPE (`tokenizer.json`), `<|endoftext|>` = {config.eos_token_id} is EOS and document separator |
| embeddings | tied (no `lm_head.weight`) |
| MTP head | 1 full-attention decoder layer, `mtp.safetensors` (`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.norm`) |
| parameters | {info["params"]["main"]:,} main + {info["params"]["mtp"]:,} MTP = {info["params"]["total"]:,} |

MTP semantics are those of Baton's docs/CONTRACTS.md: from the final-normed hidden h_t and the token
x_(t+1) the head predicts x_(t+2). Chained drafts feed the head's own `mtp.norm` output back as the
hidden state, at RoPE position t+k.

## Data
The `.py` files of the standard library of the Python {info["python"]} that ran the script
(`{c["stdlib_root"]}`, sorted, site-packages and `pydoc_data/` skipped, non-UTF-8 files skipped).
Files are split by sha256 of their relative path mod 20: 0 = held-out test ({c["files"]["test"]} files),
1 = validation for checkpoint selection ({c["files"]["val"]} files), the rest = training
({c["files"]["train"]} files, {c["bytes"]["train"]:,} bytes, {info["tokens"]["train"]:,} tokens).
The corpus is Python source distributed with CPython under the **Python Software Foundation License**;
the PSF licence applies to it, and this model is trained on it.

## Held-out results ({h["tokens"]:,} tokens of the held-out files, BF16 weights)
| metric | value |
| --- | --- |
| next-token loss (nats) | {h["next_token_loss"]:.4f} |
| perplexity | {h["perplexity"]:.2f} |
| next-token top-1 accuracy | {h["next_token_top1"]:.1%} |
| MTP loss (predicting x_(t+2)) | {h["mtp_loss"]:.4f} |
| MTP top-1 accuracy (argmax = true x_(t+2)) | {h["mtp_top1"]:.1%} |
| MTP draft = main model's greedy choice | {h["mtp_agrees_with_main_top1"]:.1%} |
| chained MTP top-1 (teacher-forced) | {chain} |
| estimated MTP acceptance, K={acc["K"]} (greedy text of {acc["rounds"]} rounds) | {acc["tokens_per_round"]:.2f} tokens per round |

The acceptance figure replays greedy speculation on the model's own greedy continuations of held-out
prompts, with the drafts computed in one teacher-forced pass; Baton's decode worker measures the real one.

## Training
{tr["steps"]:,} steps of {tr["batch"]} x {tr["seq_len"]} tokens ({tr["tokens_seen"]:,} tokens seen) in
{tr["seconds"]:.0f} s on {info["device"]} (flash-linear-attention: {info["fla"]}); whole run
{info["total_seconds"]:.0f} s. AdamW (0.9, 0.95), weight decay 0.1, peak lr {tr["lr"]}, warmup {tr["warmup"]}
steps then cosine to 10%, BF16 autocast on CUDA, gradient clip 1.0. Loss = next-token CE + {tr["mtp_weight"]} x MTP CE
(chained step k weighted {tr["mtp_weight"]}/2^(k-1), {tr["mtp_steps"]} step(s)); the MTP branch sees detached
hidden states, embeddings and lm_head, so only `mtp.*` learns from it. Kept: the step with the best
validation objective (step {tr["best_step"]}). Python {info["python"]}, torch {info["torch"]},
transformers {info["transformers"]}, seed {info["seed"]}.

Reproduce (from the repository root):

    {info["command"]}

## Sample (greedy, held-out prompt)
Prompt:
```python
{sample["prompt"]}
```
The model's continuation ({info["samples_new_tokens"]} new tokens at most, cut at `<|endoftext|>`):
```python
{sample["continuation"]}
```
"""
