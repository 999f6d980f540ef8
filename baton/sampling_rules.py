"""The rules of `baton.v1.SamplingParams`, shared by the router and the workers (no torch import).

    check(params)                        # ValueError "sampling.<field>: why" (INVALID_ARGUMENT)
    plan(params, has_tokenizer, seed)    # the router: check, -> (workers' copy, stop strings)
    ban_until(copy, prompt_len, ids)     # the workers' copy of min_tokens: ids banned below prompt_len + min_tokens
    think_budget(copy, prompt_ids, tok)  # the workers' copy of thinking_budget: structured.after_budget, or none
    resolved(params, seed) -> params     # the workers' copy: the seed set, stop strings removed
    logprob_protos(entries, tokens)      # SamplingTable.logprobs entries -> [baton.v1.TokenLogprob]
    penalized(params) -> bool            # any penalty on: the router sends the token history
    history(params, ids, generated_from) # -> baton.v1.PenaltyHistory (None when neither penalized nor structured)

Ranges (docs/CONTRACTS.md, "Sampling"): temperature in [0, 100] (0 = greedy); top_p in [0, 1] (0 or 1 =
off); top_k any (0 = off; past the vocabulary = off); min_p in [0, 1] (0 = off); logprobs <= 20; at most
16 stop strings, each 1..256 bytes of UTF-8; repetition_penalty in [0, 10] (0 or 1 = off),
presence_penalty and frequency_penalty in [-2, 2] (OpenAI's range); their semantics are in
baton/engine/penalties.py (vLLM's / OpenAI's); logit_bias: at most 300 token ids, each below the vocabulary
(when the checker knows it), each value finite in [-100, 100] (OpenAI's).
exact_policy: a known ExactPolicy value; UNSPECIFIED resolves to DEFAULT_EXACT_POLICY for the workers.
min_tokens (vLLM's): any count up to the request's max_new_tokens (checked by the router). The workers
get it resolved (`ban_until`): min_tokens_ids (at most MAX_BAN_TOKENS) cannot be picked at positions below
min_tokens_end; a request's own min_tokens_end / min_tokens_ids are refused (the router sets them).
structured: one kind set, at most 64 KiB, a json_schema a JSON object (baton/grammar.py `check`; the workers
compile it and name what xgrammar refuses).
"""

from __future__ import annotations

import math

MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20
MAX_STOPS = 16
MAX_STOP_BYTES = 256
MAX_REPETITION_PENALTY = 10.0
MAX_ABS_PENALTY = 2.0
MAX_BIAS_TOKENS = 300  # also the sampling table's per-slot room (baton.engine.sampling.MAX_BIAS)
MAX_ABS_BIAS = 100.0
MAX_BAN_TOKENS = 80  # min_tokens_ids: the router's 64 stop token ids and the model's EOS ids (the table's room)
EXACT_POLICIES = {0: "unspecified", 1: "coupling", 2: "rejection"}  # baton.v1.ExactPolicy
DEFAULT_EXACT_POLICY = 1  # COUPLING: see docs/CONTRACTS.md, "Sampling" (the measured choice)


def _bad(field: str, why: str) -> ValueError:
    return ValueError(f"sampling.{field}: {why}")


def _finite(field: str, v: float, lo: float, hi: float) -> None:
    if not math.isfinite(v) or not lo <= v <= hi:
        raise _bad(field, f"{v} is out of range [{lo:g}, {hi:g}]")


def check(p, *, stops: bool = True, vocab: int | None = None) -> None:
    """Validates a SamplingParams message; every field named as `sampling.<field>`. stops=False: the
    workers' copy, which must carry none (the router matches stop strings). vocab: logit_bias ids below it."""
    _finite("temperature", p.temperature, 0.0, MAX_TEMPERATURE)
    _finite("top_p", p.top_p, 0.0, 1.0)
    _finite("min_p", p.min_p, 0.0, 1.0)
    if p.logprobs > MAX_LOGPROBS:
        raise _bad("logprobs", f"{p.logprobs} alternatives: at most {MAX_LOGPROBS}")
    _finite("repetition_penalty", p.repetition_penalty, 0.0, MAX_REPETITION_PENALTY)
    _finite("presence_penalty", p.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
    _finite("frequency_penalty", p.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
    if p.exact_policy not in EXACT_POLICIES:
        raise _bad("exact_policy", f"{p.exact_policy} is not an ExactPolicy (0 = default, 1 = COUPLING, 2 = REJECTION)")
    if len(p.stop) > (MAX_STOPS if stops else 0):
        raise _bad("stop", f"{len(p.stop)} stop strings: at most {MAX_STOPS}" if stops else "not for workers")
    for i, s in enumerate(p.stop):
        n = len(s.encode("utf-8"))
        if not 1 <= n <= MAX_STOP_BYTES:
            raise _bad(f"stop[{i}]", f"{n} bytes: a stop string has 1..{MAX_STOP_BYTES} bytes of UTF-8")
    if len(p.logit_bias) > MAX_BIAS_TOKENS:
        raise _bad("logit_bias", f"{len(p.logit_bias)} token ids: at most {MAX_BIAS_TOKENS}")
    for t, v in sorted(p.logit_bias.items()):
        if vocab is not None and t >= vocab:
            raise _bad("logit_bias", f"token id {t} is not below the vocabulary size {vocab}")
        _finite(f"logit_bias[{t}]", v, -MAX_ABS_BIAS, MAX_ABS_BIAS)
    if p.HasField("structured"):
        from baton import grammar  # (no torch, no xgrammar: the workers compile)

        grammar.check(p.structured)
        if vocab is not None and p.structured.HasField("after_token") and p.structured.after_token >= vocab:
            raise _bad("structured.after_token", f"token id {p.structured.after_token} is not below {vocab}")
    if stops and (p.min_tokens_end or p.min_tokens_ids):
        field = "min_tokens_end" if p.min_tokens_end else "min_tokens_ids"
        raise _bad(field, "set by the router from min_tokens (send min_tokens)")
    if len(p.min_tokens_ids) > MAX_BAN_TOKENS:
        raise _bad("min_tokens_ids", f"{len(p.min_tokens_ids)} token ids: at most {MAX_BAN_TOKENS}")
    if vocab is not None and any(t >= vocab for t in p.min_tokens_ids):
        raise _bad("min_tokens_ids", f"a token id is not below the vocabulary size {vocab}")


def plan(p, has_tokenizer: bool, random_seed: int, vocab: int | None = None):
    """The router's view of a request's params: check them, then -> (the workers' copy with the seed
    resolved (the request's, else random_seed), the distinct stop strings). ValueError naming the field."""
    check(p, vocab=vocab)
    if p.stop and not has_tokenizer:
        raise _bad("stop", "this router has no tokenizer to match stop strings on the text")
    return resolved(p, p.seed if p.HasField("seed") else random_seed), tuple(dict.fromkeys(p.stop))


def resolved(p, seed: int):
    """A copy for the workers: seed set, exact_policy resolved, stop strings removed (the router matches
    them on the text)."""
    out = type(p)()
    out.CopyFrom(p)
    out.seed = seed
    out.exact_policy = p.exact_policy or DEFAULT_EXACT_POLICY
    del out.stop[:]
    return out


def ban_until(p, prompt_len: int, ids) -> None:
    """Resolves a workers' copy's min_tokens in place: `ids` (the request's stop token ids, and the model's
    EOS ids unless ignore_eos) cannot be picked at positions below prompt_len + min_tokens, i.e. by the first
    min_tokens generated tokens (the first generated token is at position prompt_len). min_tokens 0: off."""
    del p.min_tokens_ids[:]
    p.min_tokens_end = 0
    ids = sorted(set(int(t) for t in ids))
    if p.min_tokens and ids:
        if len(ids) > MAX_BAN_TOKENS:
            raise _bad("min_tokens", f"{len(ids)} stop and EOS token ids to hold back: at most {MAX_BAN_TOKENS}")
        p.min_tokens_end = prompt_len + p.min_tokens
        p.min_tokens_ids.extend(ids)


def think_budget(p, ids, tokenizer) -> None:
    """A copy's thinking_budget resolved in place (and cleared): where the prompt `ids` leave a <think> block
    open and "</think>" is one token of `tokenizer`, structured.after_budget with after_token = its id (beside a
    structure that reasons first), or alone as any_text; elsewhere nothing (vLLM's: no reasoning block, nothing
    to bound). ValueError naming sampling.thinking_budget beside structured.after_budget."""
    if not p.HasField("thinking_budget"):
        return
    budget = p.thinking_budget
    p.ClearField("thinking_budget")
    has = p.HasField("structured")
    if has and p.structured.HasField("after_budget"):
        raise _bad("thinking_budget", "not with sampling.structured.after_budget (set one)")
    if tokenizer is None:
        return
    from baton.think_tags import THINK_END, think_open

    end = tokenizer.encode(THINK_END)
    if len(end) != 1 or not think_open(tokenizer.decode(list(ids), skip_special_tokens=False)):
        return
    if has:
        if p.structured.HasField("after_token"):  # a structure after the reasoning: bound the reasoning
            p.structured.after_budget = budget
        return
    from baton.v1 import common_pb2

    p.structured.CopyFrom(common_pb2.StructuredOutput(any_text=True, after_token=end[0], after_budget=budget))


def penalized(p) -> bool:
    """A SamplingParams (or None) with any penalty on (the same test as sampling.Params.penalized)."""
    return p is not None and (
        p.repetition_penalty not in (0.0, 1.0) or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    )


def structured(p) -> bool:
    """A SamplingParams (or None) with a grammar (sampling.Params.constrained)."""
    return p is not None and p.HasField("structured")


def history(p, ids, generated_from: int):
    """The PenaltyHistory a decode worker needs with a penalized or structured session's first Decode / Draft
    after a LoadState: ids = the tokens at the state's positions [0, position) (a grammar's matcher replays the
    generated ones); None when p has neither."""
    if not penalized(p) and not structured(p):
        return None
    from baton.v1 import common_pb2

    return common_pb2.PenaltyHistory(token_ids=list(ids), generated_from=generated_from)


def logprob_protos(entries, tokens) -> list:
    """[(chosen logprob, [(id, logprob)])] of SamplingTable.logprobs and their tokens -> TokenLogprob list."""
    from baton.v1 import common_pb2

    return [
        common_pb2.TokenLogprob(
            token_id=int(t), logprob=lp, top=[common_pb2.TopLogprob(token_id=int(i), logprob=v) for i, v in top]
        )
        for t, (lp, top) in zip(tokens, entries)
    ]
