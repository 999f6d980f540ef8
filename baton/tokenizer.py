"""Tokenizer: a thin wrapper over the `tokenizers` library reading a local `tokenizer.json` only.

No network, no transformers. Text <-> ids without special-token insertion, plus `StreamDecoder`,
which turns a token stream into text deltas that never split a multi-byte UTF-8 character:
    concat(push(t) for t in ids) + flush() == decode(ids)      (same skip_special_tokens)
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from baton.config import ModelConfig

TOKENIZER_FILE = "tokenizer.json"
EOS_TOKENS = ("<|endoftext|>", "<|im_end|>")
_REPLACEMENT = "\ufffd"  # what the decoder emits for an incomplete / invalid UTF-8 byte run


class TokenizerError(ValueError):
    """tokenizer.json is missing or unreadable."""


class Tokenizer:
    def __init__(self, tk: _HFTokenizer, eos_token_ids: tuple[int, ...] = ()):
        self._tk = tk
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(set(eos_token_ids)))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load `<dir>/tokenizer.json`. EOS ids = config.json's eos_token_id (if config.json exists)
        plus the ids of `<|endoftext|>` / `<|im_end|>` when the vocabulary has them."""
        path = Path(model_dir) / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(f"missing file: {path} (a model directory needs {TOKENIZER_FILE})")
        try:
            tk = _HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed JSON
            raise TokenizerError(f"cannot read {path}: {e}") from e
        eos = set()
        if (Path(model_dir) / "config.json").is_file():
            eos.update(ModelConfig.from_hf(model_dir).eos_token_ids)
        for name in EOS_TOKENS:
            i = tk.token_to_id(name)
            if i is not None:
                eos.add(i)
        return cls(tk, tuple(eos))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added/special tokens included)."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids for `text`; no BOS/EOS or template tokens are added."""
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    def stream(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns the newly completed text ('' while a character's
    bytes are still pending), `flush()` returns whatever is left (incomplete bytes as U+FFFD).

    Invariant: ids[prefix:read] (prefix is always 0 after trimming) is the last emitted segment (kept as left context so decoders that
    strip a leading space see it); ids[read:] are pending. Text is emitted only when decoding the
    window does not end in U+FFFD, i.e. ends on a complete character, so the byte boundary at `read`
    is a character boundary of the full sequence.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context segment
        self._read = 0  # end of emitted text, in tokens

    def _delta(self, force: bool) -> str:
        context = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(text) <= len(context) and not force:
            return ""
        if text.endswith(_REPLACEMENT) and not force:
            return ""
        # NOTE: `text` starts with `context` because `read` sits on a character boundary.
        self._ids = self._ids[self._read :]  # drop what no longer serves as context
        self._prefix, self._read = 0, len(self._ids)
        return text[len(context) :]

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        return self._delta(force=False)

    def flush(self) -> str:
        """Emit pending text, even if it ends in an incomplete character."""
        return self._delta(force=True) if self._read < len(self._ids) else ""

    @property
    def pending(self) -> int:
        """Tokens pushed but not yet reflected in emitted text."""
        return len(self._ids) - self._read
