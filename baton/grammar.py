"""Structured outputs: a request's grammar (`SamplingParams.structured`) as the set of tokens it allows next.

    grammars = Grammars.of_model(model_dir, vocab_size, eos_ids)   # one per worker (compiled grammars cached)
    engine.grammars = source(model_dir, vocab_size, eos_ids)       # the same, built on first use
    c = grammars.constraint(spec_bytes)   # a matcher at the start of the output; ValueError for a bad grammar
    c.accept(tokens)                      # advance over generated tokens; ValueError for one it does not allow
    c.fill(bits)                          # bits [words(V)] int32: bit t of word t // 32 set = token t allowed
    check(spec)                           # the router's cheap check of a StructuredOutput (no compile)

Compiling and matching are xgrammar's (a well-kept library: vLLM's and SGLang's default backend). A spec is
a `baton.v1.StructuredOutput`, carried serialized (deterministic bytes) in `Params.structured`, so equal
grammars share one compile. The mask depends only on the grammar and the tokens accepted so far: any worker
rebuilds it from the session's generated tokens (a hand-off, a migration's re-prefill), and the rows of one
slot never see another's (batch invariance: baton/engine/sample_rows.py applies it per row).

Lifecycle (docs/CONTRACTS.md, "Structured outputs"): the prefill worker builds a session's constraint, accepts
the generated tokens a re-prefill replays, and masks the first pick; the decode worker builds it again from the
history the router sends with the first Decode, accepts the pending token, then after every token it hands
out accepts it and writes the next mask before the session's next step (such a session never runs ahead).
In exact mode the prefill worker's Verify masks each block row after the drafts before it (`Masker.block`)
and its matcher takes what the verify keeps (`Masker.commit`); the drafts follow the grammar too (`draft_row`).
The grammar's end allows only EOS, so a finished structure ends the request there.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
from pathlib import Path

MAX_SPEC_BYTES = 64 * 1024  # a schema / regex / grammar / the choices together
MAX_CHOICES = 256
MAX_WHITESPACE = 32  # JSON's whitespace characters in one run (an indent 8 levels deep fits)
KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag", "any_text")


class Unavailable(ValueError):
    """This worker cannot compile grammars: its model has no tokenizer.json, or xgrammar is missing or broken
    (the workers answer FAILED_PRECONDITION)."""


def words(vocab_size: int) -> int:
    """int32 words of one row's mask."""
    return (vocab_size + 31) // 32


def check(spec) -> None:
    """ValueError "sampling.structured...: why" for a StructuredOutput no worker could compile for sure: the
    router's check, without xgrammar (a schema must be a JSON object; a regex / grammar non-empty)."""
    kind = spec.WhichOneof("kind")
    if kind is None:
        raise ValueError("sampling.structured: set one of " + ", ".join(KINDS))
    if spec.ByteSize() > MAX_SPEC_BYTES:
        raise ValueError(f"sampling.structured: {spec.ByteSize()} bytes, at most {MAX_SPEC_BYTES}")
    if spec.HasField("after_budget") and not spec.HasField("after_token"):
        raise ValueError("sampling.structured.after_budget: a budget of tokens before after_token: set after_token")
    if kind == "any_text" and not (spec.any_text and spec.HasField("after_budget")):
        raise ValueError(
            "sampling.structured.any_text: true, with after_token and after_budget (a thinking budget alone); "
            "for no structure leave sampling.structured unset"
        )
    if kind == "json_schema":
        try:
            schema = json.loads(spec.json_schema)
        except ValueError as e:
            raise ValueError(f"sampling.structured.json_schema: not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("sampling.structured.json_schema: a JSON Schema is a JSON object")
    elif kind == "json_object" and not spec.json_object:
        raise ValueError("sampling.structured.json_object: true, or set another kind")
    elif kind in ("regex", "grammar") and not getattr(spec, kind):
        raise ValueError(f"sampling.structured.{kind}: empty")
    elif kind == "structural_tag":
        try:
            tag = json.loads(spec.structural_tag)
        except ValueError as e:
            raise ValueError(f"sampling.structured.structural_tag: not JSON: {e}") from None
        if not isinstance(tag, dict) or tag.get("type") != "structural_tag" or not {"format", "structures"} & set(tag):
            raise ValueError(
                'sampling.structured.structural_tag: {"type": "structural_tag", "format": {...}} (or vLLM\'s '
                '"structures" and "triggers")'
            )
    elif kind == "choice":
        opts = list(spec.choice.options)
        if not opts or len(opts) > MAX_CHOICES or not all(opts):
            raise ValueError(f"sampling.structured.choice: 1..{MAX_CHOICES} non-empty strings")


def _choice_grammar(options) -> str:
    """EBNF of exactly one of the strings (JSON string literals: xgrammar's EBNF reads the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in dict.fromkeys(options))


class Constraint:
    """One session's matcher: the tokens accepted so far and what may follow.

    after (StructuredOutput.after_token, a reasoning model's "</think>"): until that token is accepted every
    token is allowed (all mask bits set: the pick is the unconstrained one, bitwise) and none reaches the
    grammar; it and the tokens after it do. Each accepted token is logged (fed to the grammar or not), so a
    rollback across the switch (a verify block's rows) returns to the free part.
    budget (StructuredOutput.after_budget, a thinking budget): once that many tokens were accepted before
    `after`, only `after` is allowed (the mask's one bit; any other token is refused).
    matcher None (StructuredOutput.any_text): no grammar after `after`, every token allowed there too."""

    def __init__(self, matcher, vocab_size: int, after: int | None = None, budget: int | None = None):
        self._m, self.vocab_size = matcher, vocab_size  # (xgrammar's GrammarMatcher: rollback unlimited)
        self._after, self.budget = after, budget
        self._log: list[bool] = []  # with `after`: per accepted token, whether the grammar took it
        self._switch = -1  # the index in _log of the `after` token that began the grammar (-1: not yet)

    def accept(self, tokens) -> None:
        for t in tokens:
            if not self.try_accept(t):
                raise ValueError(f"sampling.structured: token {int(t)} does not continue the grammar")

    def try_accept(self, token: int) -> bool:
        """Accepts token if the grammar allows it here; False (nothing accepted) if not."""
        t = int(token)
        if self.free:
            if t == self._after:
                self._switch = len(self._log)
            elif self.spent:
                return False
            self._log.append(False)
            return True
        if self._m is None:  # any_text: nothing after the switch is refused
            self._log.append(False)
            return True
        if not self._m.accept_token(t):
            return False
        if self._after is not None:
            self._log.append(True)
        return True

    def rollback(self, n: int) -> None:
        """Undoes the last n accepted tokens."""
        if self._after is None:
            self._m.rollback(n)
            return
        keep = len(self._log) - n
        fed = sum(self._log[keep:])
        del self._log[keep:]
        if fed:
            self._m.rollback(fed)
        if self._switch >= keep:  # the `after` token itself was undone
            self._switch = -1

    def fill(self, bits) -> None:
        """bits: a [words] int32 CPU tensor (a row of a larger one is fine), overwritten with the allowed set."""
        if self.spent:  # the budget's end: only the after token
            bits.zero_()
            bits[self._after // 32] = _bit(self._after % 32)
        elif self.free or self._m is None:
            bits.fill_(-1)
        else:
            self._m.fill_next_token_bitmask(bits.view(1, -1), 0)

    @property
    def finished(self) -> bool:
        return not self.free and self._m is not None and self._m.is_terminated()

    @property
    def spent(self) -> bool:
        """Still free, with its budget of tokens before `after` used up: the next token must be `after`."""
        return self.free and self.budget is not None and len(self._log) >= self.budget

    @property
    def budget_left(self) -> int | None:
        """While free: the tokens it may still accept before `after` must come (None: no budget)."""
        return None if self.budget is None else max(self.budget - len(self._log), 0)

    @property
    def grammarless(self) -> bool:
        """any_text: after its `after` token nothing is masked."""
        return self._m is None

    @property
    def free(self) -> bool:
        """Before its after_token: every token allowed (the grammar not begun)."""
        return self._after is not None and self._switch < 0

    @property
    def after(self) -> int | None:
        return self._after


class Grammars:
    """xgrammar's compiler for one tokenizer; compiled grammars cached by spec bytes (thread-safe)."""

    def __init__(self, tokenizer_info, vocab_size: int):
        import xgrammar as xgr

        self._xgr, self.vocab_size = xgr, vocab_size
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=2)
        self._lock = threading.Lock()
        self._compiled = functools.lru_cache(maxsize=256)(self._compile)

    @classmethod
    def of_model(cls, model_dir: str | Path | None, vocab_size: int, eos_ids) -> "Grammars":
        """From the checkpoint's tokenizer.json. ValueError when the model has none (a random-init model)
        or xgrammar is missing."""
        if model_dir is None or not (Path(model_dir) / "tokenizer.json").is_file():
            raise Unavailable("sampling.structured: this worker's model has no tokenizer.json")
        return _of_model(str(model_dir), vocab_size, tuple(sorted(eos_ids)))

    def _compile(self, spec_bytes: bytes):
        from baton.v1 import common_pb2

        spec = common_pb2.StructuredOutput.FromString(spec_bytes)
        kind, c = spec.WhichOneof("kind"), self._compiler
        try:
            if kind in ("json_schema", "json_object"):  # json_object: an object (xgrammar's builtin: any value)
                schema = spec.json_schema if kind == "json_schema" else '{"type": "object"}'
                return c.compile_json_schema(schema, **self._whitespace(spec))
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "grammar":
                return c.compile_grammar(spec.grammar)
            if kind == "choice":
                return c.compile_grammar(_choice_grammar(spec.choice.options))
            if kind == "structural_tag":
                return self._structural_tag(json.loads(spec.structural_tag))
        except (RuntimeError, ValueError, TypeError, KeyError) as e:  # xgrammar's carry "[time] file:line: why"
            line = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            why = line.split("is false: ", 1)[-1] if "is false: " in line else line.split(": ", 1)[-1]
            raise ValueError(f"sampling.structured.{kind}: {why}") from None
        raise ValueError("sampling.structured: set one of " + ", ".join(KINDS))

    def _structural_tag(self, tag: dict):
        """xgrammar's structural tag ({"format": ...}), or vLLM's older form: {"structures": [{"begin", "schema",
        "end"}], "triggers": [...]} (each structure's schema between its begin and end once a trigger starts it)."""
        if "format" in tag:
            return self._compiler.compile_structural_tag(json.dumps(tag))
        items = [
            self._xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
            for s in tag["structures"]
        ]
        return self._compiler.compile_structural_tag(items, list(tag.get("triggers", ())))

    @staticmethod
    def _whitespace(spec) -> dict:
        """JSON's whitespace: none (compact_whitespace), else any, in runs of at most MAX_WHITESPACE characters
        (pretty-printed JSON fits; a model that would pad forever is stopped)."""
        if spec.compact_whitespace:
            return {"any_whitespace": False}
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}

    def constraint(self, spec_bytes: bytes) -> Constraint:
        """A fresh matcher of the spec (compiled once per spec; its after_token and after_budget are the
        Constraint's own, so they share the grammar's compile)."""
        spec, after, budget = _split(spec_bytes)
        with self._lock:
            compiled = self._compiled(spec.SerializeToString(deterministic=True))
        return Constraint(self._xgr.GrammarMatcher(compiled), self.vocab_size, after, budget)


def _bit(i: int) -> int:
    """Bit i (0..31) of an int32 word, as the signed value torch stores."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def _split(spec_bytes: bytes):
    """-> (the StructuredOutput without after_token / after_budget, after_token or None, after_budget or None)."""
    from baton.v1 import common_pb2

    spec = common_pb2.StructuredOutput.FromString(bytes(spec_bytes))
    after = spec.after_token if spec.HasField("after_token") else None
    budget = spec.after_budget if spec.HasField("after_budget") else None
    spec.ClearField("after_token")
    spec.ClearField("after_budget")
    return spec, after, budget


def constraint(grammars, spec_bytes: bytes, vocab_size: int) -> Constraint:
    """A session's Constraint of a serialized StructuredOutput. grammars: the engine's source of its Grammars
    (`source`, `none`), asked only for a grammar: a thinking budget alone (any_text) compiles nothing, so a
    worker without a tokenizer or xgrammar serves it."""
    spec, after, budget = _split(spec_bytes)
    if spec.WhichOneof("kind") == "any_text":
        return Constraint(None, vocab_size, after, budget)
    return grammars().constraint(spec_bytes)


@functools.lru_cache(maxsize=4)
def _of_model(model_dir: str, vocab_size: int, eos_ids: tuple[int, ...]) -> Grammars:
    try:  # an import that fails, or an xgrammar without its API (seen on the GPU machine): a clear refusal
        import xgrammar as xgr
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")))
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(eos_ids) or None)
        return Grammars(info, vocab_size)
    except (ImportError, AttributeError) as e:
        where = getattr(sys.modules.get("xgrammar"), "__file__", None)
        raise Unavailable(
            f"sampling.structured: this worker cannot compile grammars ({e}; xgrammar at {where})"
        ) from None


def source(model_dir, vocab_size: int, eos_ids):
    """-> a callable giving the model's Grammars, built on its first call (xgrammar and the tokenizer are
    loaded only by a worker that gets a structured request); it raises the ValueError of_model raises."""
    return lambda: Grammars.of_model(model_dir, vocab_size, eos_ids)


def none():
    """The grammars of an engine that was given none (a model without a tokenizer)."""
    raise Unavailable("sampling.structured: this worker's model has no tokenizer to compile grammars with")


class Masker:
    """One constrained session's masks on its slot of a SamplingTable (`SamplingTable.allow`: the mask of the
    pick at position q lives in row q % W). `next` is the position of the session's next pick.

        m.start(tokens, next)   # accept the tokens generated so far (a hand-off's, a re-prefill's), mask `next`
        m.step(tokens)          # accept the tokens handed out (AR), mask the pick after them
        m.block(start, tokens)  # a verify block [t0, d1..dK] (t0 at `start`): row j's mask after d1..dj
        m.draft_row(start, tokens)  # before a draft chain's step j (tokens [t0, d1..dj]): its pick's mask
        m.commit(tokens)        # accept a verify's kept drafts and its token (the next block masks its rows)

    One pinned [W, words] buffer, rewritten only after a pass that read the last copy has been collected."""

    def __init__(self, constraint: Constraint, table, slot: int):
        import torch

        self.c, self.table, self.slot, self.next = constraint, table, slot, 0
        W, n = table.mask_bits.shape[1:]
        self.bits = torch.empty(W, n, dtype=torch.int32, pin_memory=table.mask_bits.is_cuda)

    def start(self, tokens, next_position: int) -> None:
        self.c.accept(tokens)
        self.next = next_position
        self._write(1)

    def step(self, tokens=()) -> None:
        if self.c.finished:  # EOS accepted (a caller that ignores EOS): the mask stays "EOS only"
            return
        self.commit(tokens)
        self._write(1)

    def commit(self, tokens) -> None:
        """Tokens past the grammar's end (drafts a verify kept after a drafted EOS) are not fed: the request ends."""
        for t in tokens:
            if self.c.finished:
                break
            self.c.accept([t])
        self.next += len(tokens)

    def block(self, start: int, tokens) -> None:
        """tokens = [t0, d1..dK], t0 the pending token at position `start`: rows start + 1 + j get the mask after
        t0, d1..dj (t0 accepted first if this matcher has not seen it: the prefill's first token: at). A refused
        draft ends the masks (its row cannot pick it: the verify keeps no draft past it); the rows after it are free."""
        self.at(start, tokens[0])
        rows, taken = len(tokens), 0
        self.bits[:rows].fill_(-1)
        for j in range(rows):
            if self.c.finished:  # a draft ended the grammar (EOS): the verify ends there, the rows after are free
                break
            self.c.fill(self.bits[j])
            if j + 1 == rows or not self.c.try_accept(tokens[j + 1]):
                break
            taken += 1
        if taken:
            self.c.rollback(taken)
        self.table.allow(self.slot, start + 1, self.bits[:rows])

    def draft_row(self, start: int, tokens) -> None:
        """tokens = [t0, d1..dj] (t0 the pending token at `start`), a fast mtp chain's drafts so far: row
        start + 1 + j gets the mask after them, for the head's draft j + 1 (block later rewrites the rows). The
        matcher is left where it was (t0 accepted first if unseen, as in block: at). A refused draft, or one past
        the grammar's end, leaves the row allowing everything. Uses bits row W - 1 - j, not row 0 (step()'s
        copy may still be in flight); each chain step's host read passes its copy before block's rewrite."""
        self.at(start, tokens[0])
        j, taken = len(tokens) - 1, 0
        row = self.bits[self.bits.shape[0] - 1 - j]
        for t in tokens[1:]:
            if self.c.finished or not self.c.try_accept(t):
                break
            taken += 1
        if taken == j and not self.c.finished:
            self.c.fill(row)
        else:  # refused, or after the grammar's end (a drafted EOS): the verify keeps nothing past it
            row.fill_(-1)
        if taken:
            self.c.rollback(taken)
        self.table.allow(self.slot, start + 1 + j, row[None])

    def at(self, start: int, t0: int) -> None:
        """A block or chain from pending token t0 at `start`: t0 accepted if this matcher has not seen it."""
        if self.next == start:
            self.commit([t0])
        if self.next != start + 1:
            raise RuntimeError(f"structured: the matcher is at position {self.next}, the block starts at {start}")

    def _write(self, n: int) -> None:
        self.c.fill(self.bits[0])
        self.table.allow(self.slot, self.next, self.bits[:n])
