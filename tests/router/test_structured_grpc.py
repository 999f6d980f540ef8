"""Structured outputs over real loopback gRPC (SamplingParams.structured): a router, a prefill worker and decode
workers in this process on the embedded default model.

Fast bf16 gives exactly the exact engine's constrained decode (`complete` with the same grammar), greedy and
seeded, for a JSON Schema, JSON object, regex, EBNF grammar and a choice; each output follows its grammar and
ends at EOS; fp8 outputs follow theirs; 8 concurrent requests (constrained and not) each give their tokens
alone; a decode worker stopped mid-stream: the re-prefilled session goes on under the same grammar with the
same tokens; fast mtp gives the exact engine's tokens too (its masked picks in plain rounds); refusals name
sampling.structured (ignore_eos, a bad schema, a regex the workers' compiler refuses) and the next request
is served.
"""

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from helpers import inprocess_cluster

from baton.client import structured_output
from baton.engine.sampling import Params

MAX_LEN = 256
pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = "Describe a user as JSON:"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
SPECS = {
    "json_schema": {"json_schema": SCHEMA, "compact_whitespace": True},  # (the tiny model loves whitespace)
    "json_object": {"json_object": True, "compact_whitespace": True},
    "regex": {"regex": "[a-z]{2,8}@[a-z]{2,8}\\.(com|org)"},
    "grammar": {"grammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'},
    "choice": {"choice": ["red", "green", "blue"]},
    "structural_tag": {  # xgrammar's structural tag (what the HTTP API builds for a forced tool call)
        "structural_tag": {
            "type": "structural_tag",
            "format": {
                "type": "sequence",
                "elements": [{"type": "const_string", "value": "id="}, {"type": "regex", "pattern": "[0-9]{2,4}"}],
            },
        }
    },
}


def follows(kind: str, text: str) -> bool:
    if kind == "json_schema":
        v = json.loads(text)
        return set(v) == {"name", "age"} and isinstance(v["name"], str) and isinstance(v["age"], int)
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(SPECS["regex"]["regex"], text) is not None
    if kind == "grammar":
        return re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text) is not None
    if kind == "structural_tag":
        return re.fullmatch(r"id=[0-9]{2,4}", text) is not None
    return text in SPECS["choice"]["choice"]


@pytest.fixture(scope="module")
def lm():
    from baton.loading import load_model

    return load_model(None, dtype="fp32", device="cpu", mtp=True)


def _cluster(lm, decodes: int = 1):
    return inprocess_cluster(
        lm, MAX_LEN, decodes=decodes, default_engine="mtp"
    )  # (an unnamed engine is bf16 for a grammar)


@pytest.fixture(scope="module")
def client(lm):
    c, _, close = _cluster(lm)
    yield c
    close()


@pytest.fixture(scope="module")
def exact(lm):
    """The exact engine's constrained decode in process (`baton complete`'s path), stopping at EOS."""
    from baton.complete import complete
    from baton.loading import resolve_model_dir
    from baton.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model_dir(None))

    def ref(spec, n, **kw):
        s = structured_output(spec).SerializeToString(deterministic=True)
        return complete(None, tok.encode(PROMPT), n, loaded=lm, max_len=MAX_LEN, sampling=Params(structured=s, **kw))

    return ref


def run(c, n=48, **kw):
    ids, text, last = [], "", None
    for d in c.generate(PROMPT, max_new_tokens=n, timeout=120, **kw):
        ids += d.token_ids
        text += d.text
        last = d
    return ids, text, last


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_fast_bf16_is_the_exact_engines_constrained_decode_and_follows_the_grammar(client, exact, kind):
    """Greedy and seeded T = 0.9: the tokens of the exact engine with the same grammar; the text follows it and
    the request ends at EOS (the grammar allows nothing else once complete; JSON object's greedy one is cut by
    max_new_tokens: the embedded model never closes its string)."""
    for extra in (dict(), dict(temperature=0.9, seed=11)):
        ids, text, last = run(client, structured=SPECS[kind], engine="bf16", **extra)
        assert ids == exact(SPECS[kind], 48, **extra), (kind, extra)
        if kind == "json_object" and last.finish_reason == "LENGTH":  # an open object: the tiny model rambles
            assert text.startswith("{") and len(ids) == 48
            continue
        assert last.finish_reason == "EOS" and follows(kind, text), (kind, extra, text)


def test_fast_mtp_takes_a_grammar_token_identical_alone_and_among_other_mtp_sessions(client, exact, lm, monkeypatch):
    """Fast mtp with a grammar: a masked session speculates too, its drafts masked by the grammar
    (Masker.draft_row) and each verify row masked by the grammar after the block's tokens before it
    (Masker.block, from mtp._round), a reasoning part
    before an after_token unmasked; the tokens are the exact engine's constrained decode for every kind (greedy;
    seeded: a regex here, a schema and a budget before a regex below), and the same among other mtp sessions (plain ones, constrained ones, a thinking budget before a
    grammar) as alone."""
    from baton import grammar
    from baton.complete import complete
    from baton.engine.draft_length import FixedLength
    from baton.loading import resolve_model_dir
    from baton.tokenizer import Tokenizer
    from decode_worker import mtp

    blocks, block = [], grammar.Masker.block
    monkeypatch.setattr(
        grammar.Masker, "block", lambda self, start, toks: (blocks.append(len(toks)), block(self, start, toks))[1]
    )
    fixed = FixedLength(3)  # K = 3 every round: the worker's adaptive K (shared, timed) may have settled on 0
    monkeypatch.setattr(mtp, "control", lambda engine, k=None: fixed)

    for kind, extra in [(k, {}) for k in sorted(SPECS)] + [("regex", dict(temperature=0.9, seed=11))]:
        ids, text, last = run(client, structured=SPECS[kind], engine="mtp", **extra)
        assert ids == exact(SPECS[kind], 48, **extra), (kind, extra)
        assert last.stats["mean_accept_len"] >= 1.0, last.stats  # tokens a round (Stats.mean_accept_len)
    assert run(client, engine="bf16")[2].stats["mean_accept_len"] == 0.0  # (fast mtp's alone)
    free = complete(None, Tokenizer.from_dir(resolve_model_dir(None)).encode(PROMPT), 8, loaded=lm, max_len=MAX_LEN)
    at = next(i for i in range(3, 8) if free[i] not in free[:i])
    reasoning = {**AN_EMAIL, "after_token": free[at]}  # free, in mtp rounds, until the model writes it
    end, _ = _no_token_written(lm)
    budget = {**AN_EMAIL, "after_token": end, "after_budget": 5}  # free for 5 tokens, then forced, then masked
    jobs = [dict(structured=reasoning), dict(structured=budget, **SEEDED), dict(structured=SPECS["grammar"])]
    jobs += [dict(structured=SPECS["json_schema"], temperature=0.8, seed=3), dict(), dict(**SEEDED)]
    for kw in jobs[:2]:
        assert run(client, engine="mtp", **kw)[0] == exact(kw["structured"], 48, **SEEDED if "seed" in kw else {})
    alone = [run(client, engine="mtp", **kw)[0] for kw in jobs]
    with ThreadPoolExecutor(len(jobs)) as ex:
        assert list(ex.map(lambda kw: run(client, engine="mtp", **kw)[0], jobs)) == alone
    assert len(blocks) >= 5 and max(blocks) >= 3, blocks  # masked sessions' speculative rounds


def test_a_masked_sessions_drafts_follow_its_grammar(client, exact, monkeypatch):
    """Masker.draft_row: each chain step's pick is masked by the grammar after the drafts before it, so at K = 3
    every draft a masked session proposes is one its grammar allows (until the grammar ends), and more of
    them are kept than unconstrained drafts (BATON_MTP_MASKED_DRAFTS=0, the old path): the tokens are the exact
    engine's constrained decode either way."""
    from baton.engine.draft_length import FixedLength
    from decode_worker import mtp

    fixed = FixedLength(3)
    monkeypatch.setattr(mtp, "control", lambda engine, k=None: fixed)
    seen = _recording_blocks(monkeypatch)
    accept = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(mtp.MASKED_DRAFTS_ENV, mode)
        seen.clear()
        accept[mode] = []
        for kind in ("json_schema", "grammar", "choice"):
            ids, _, last = run(client, structured=SPECS[kind], engine="mtp")
            assert ids == exact(SPECS[kind], 48), (mode, kind)
            accept[mode].append(last.stats["mean_accept_len"])
        refused = [x for x in seen if x[0] < x[1] and not x[2]]
        if mode == "1":
            assert len(seen) >= 8 and not refused, refused
        else:
            assert refused, seen  # unconstrained drafts: the grammar refuses some
    assert sum(accept["1"]) > sum(accept["0"]) and all(a >= b for a, b in zip(accept["1"], accept["0"])), accept


def test_the_default_engine_is_bf16_for_a_grammar_and_fp8_follows_it_too(client, exact):
    """The decode workers here default to mtp: an unnamed engine is bf16 for a structured request (its masked
    steps are bf16's, not mtp's plain rounds; the exact engine's tokens either way); fp8's own tokens follow
    the grammar."""
    assert run(client, structured=SPECS["regex"])[0] == exact(SPECS["regex"], 48)
    for kind in sorted(SPECS):
        _, text, last = run(client, structured=SPECS[kind], engine="fp8", temperature=0.9, seed=5)
        assert last.finish_reason == "EOS" and follows(kind, text), (kind, text)


def test_eight_concurrent_requests_constrained_or_not_each_give_their_tokens_alone(client):
    jobs = [dict(structured=SPECS[k], temperature=0.8, seed=i) for i, k in enumerate(sorted(SPECS))]
    budget = {"any_text": True, "after_token": 500, "after_budget": 5}  # a thinking budget alone
    jobs += [dict(structured=budget, temperature=0.8, seed=41), dict()][: 8 - len(jobs)]  # 8: the workers' slots
    alone = [run(client, engine="bf16", **kw)[0] for kw in jobs]
    with ThreadPoolExecutor(len(jobs)) as ex:
        together = list(ex.map(lambda kw: run(client, engine="bf16", **kw)[0], jobs))
    assert together == alone


def test_a_grammar_survives_a_decode_worker_stopped_mid_stream(lm, exact):
    """The router re-prefills prompt + sent tokens on the other decode worker: the prefill worker's matcher
    replays the generated tokens for the next pick's mask, the decode worker's matcher replays the history."""
    c, ds, close = _cluster(lm, decodes=2)
    try:
        spec, kw = {"regex": "[a-z]{60,90}"}, dict(temperature=1.0, seed=8)
        want = exact(spec, 40, **kw)
        got, stopped, last = [], threading.Event(), None
        for d in c.generate(PROMPT, max_new_tokens=40, timeout=120, structured=spec, engine="bf16", **kw):
            got += d.token_ids
            last = d
            if len(got) >= 6 and not stopped.is_set():
                (busy,) = [h for h in ds if h.servicer.engine.session_count()]
                busy.stop(0)
                stopped.set()
        assert stopped.is_set() and got == want and last.stats["migrations"] == 1
    finally:
        close()


@pytest.mark.parametrize("engine", ["fp8", "mtp"])
def test_exact_mode_is_token_identical_to_the_exact_constrained_decode(client, exact, engine):
    """Exact mode: the drafts are proposals (unconstrained), the Verify's rows are masked by the grammar after
    the block's tokens before them, and its matcher takes what the verify keeps; the tokens are exactly the
    exact engine's constrained decode, greedy and seeded (coupling and rejection), for every kind."""
    seeded = dict(temperature=0.9, seed=12)
    cases = [(k, {}) for k in sorted(SPECS)] + [("json_schema", seeded), ("grammar", seeded)]
    cases += [("regex", dict(temperature=0.9, seed=13, exact_policy="rejection"))]
    if engine == "fp8":  # (fp8's drafts are slow on the CPU: three of the cases)
        cases = [cases[0], cases[-2], cases[-1]]
    for kind, extra in cases:
        ids, text, last = run(client, structured=SPECS[kind], mode="exact", engine=engine, **extra)
        want = exact(SPECS[kind], 48, **{k: v for k, v in extra.items() if k != "exact_policy"})
        if extra.get("exact_policy") == "rejection":  # exact in distribution, not token-identical; the regex's
            assert last.finish_reason == "EOS" and follows(kind, text), (kind, text)  # ~20 chars end by 48
            continue
        assert ids == want, (engine, kind, extra)
        assert last.stats["drafted"] > 0


def _recording_blocks(monkeypatch) -> list:
    """Masker.block (the verify's, on either worker) recording per block (drafts its grammar takes, drafts,
    whether a draft ended the grammar) before it runs."""
    from baton import grammar

    seen, block = [], grammar.Masker.block

    def recording(self, start, toks):
        self.at(start, toks[0])  # t0 accepted first if unseen (block does the same, then finds it done)
        n, ended = 0, False
        for t in toks[1:]:
            if self.c.finished:  # a draft was EOS: the drafts after it are past the grammar's end
                ended = True
                break
            if not self.c.try_accept(t):
                break
            n += 1
        if n:
            self.c.rollback(n)
        seen.append((n, len(toks) - 1, ended))
        return block(self, start, toks)

    monkeypatch.setattr(grammar.Masker, "block", recording)
    return seen


@pytest.mark.parametrize("engine", ["mtp", "fp8"])
def test_exact_modes_drafts_follow_the_grammar(client, exact, monkeypatch, engine):
    """Exact mode: the decode worker masks each draft's pick by the session's grammar after the tokens before it
    (its draft Masker, started from the first Draft's history, advanced by each verdict): every draft the
    exact worker's Verify sees is one the grammar allows (until it ends), and more of them are kept than
    unconstrained drafts (BATON_MTP_MASKED_DRAFTS=0); the tokens are the exact engine's constrained decode
    either way, greedy and seeded."""
    from decode_worker import mtp

    seen = _recording_blocks(monkeypatch)
    cases = [("json_schema", {}), ("grammar", {}), ("choice", dict(temperature=0.9, seed=12))]
    if engine == "fp8":  # (fp8's drafts are slow on the CPU)
        cases = cases[:1]
    rate = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(mtp.MASKED_DRAFTS_ENV, mode)
        seen.clear()
        rate[mode] = []
        for kind, extra in cases:
            ids, _, last = run(client, structured=SPECS[kind], mode="exact", engine=engine, **extra)
            assert ids == exact(SPECS[kind], 48, **extra), (mode, kind, extra)
            rate[mode].append(last.stats["accepted"] / last.stats["drafted"])
        refused = [x for x in seen if x[0] < x[1] and not x[2]]
        if mode == "1":
            assert len(seen) >= 2 * len(cases) and not refused, refused
        else:
            assert refused, seen  # unconstrained drafts: the grammar refuses some
    assert sum(rate["1"]) > sum(rate["0"]), rate


def test_a_grammar_after_a_token_leaves_what_comes_before_it_free(client, exact, lm):
    """StructuredOutput.after_token (a reasoning model's </think>; here a token the model writes fourth): the
    tokens up to it are the unconstrained decode's, the text after it follows the grammar, and fast bf16 and
    exact mode (mtp drafts, greedy and seeded) are token-identical to the exact engine's decode with the spec."""
    from baton.complete import complete
    from baton.loading import resolve_model_dir
    from baton.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model_dir(None))
    free = complete(None, tok.encode(PROMPT), 8, loaded=lm, max_len=MAX_LEN)
    at = next(i for i in range(3, 8) if free[i] not in free[:i])  # its first appearance: the switch
    spec = {"regex": "[a-z]{3,12}@[a-z]{3,8}\\.com", "after_token": free[at]}
    for extra in (dict(), dict(temperature=0.9, seed=27), dict(temperature=0.9, seed=21)):  # (27 writes it)
        want = exact(spec, 48, **extra)
        if not extra:
            assert want[: at + 1] == free[: at + 1]  # before the switch: the unconstrained tokens
        for kw in (dict(engine="bf16"), dict(mode="exact", engine="mtp")):
            ids, text, last = run(client, structured=spec, **kw, **extra)
            assert ids == want, (kw, extra)
            if spec["after_token"] not in ids:  # a sampled decode that never wrote it (seed 21): free to the end
                assert extra["seed"] == 21 and last.finish_reason == "LENGTH" and len(ids) == 48
                continue
            k = ids.index(spec["after_token"])
            after = tok.decode(ids[k + 1 :], skip_special_tokens=True)
            assert last.finish_reason == "EOS" and re.fullmatch(spec["regex"], after), (kw, extra, after)
    # the after_token also a stop token id: the request ends there (it is not taken for the switch)
    ids, _, last = run(client, structured=spec, engine="bf16", stop_token_ids=[spec["after_token"]])
    assert ids == free[: at + 1] and last.finish_reason == "STOP"


def _no_token_written(lm) -> int:
    """A token id the embedded model does not write in its first 48 greedy tokens after PROMPT (a budget's
    after_token, so that it comes where the budget forces it)."""
    from baton.complete import complete
    from baton.loading import resolve_model_dir
    from baton.tokenizer import Tokenizer

    free = complete(None, Tokenizer.from_dir(resolve_model_dir(None)).encode(PROMPT), 48, loaded=lm, max_len=MAX_LEN)
    return next(t for t in range(100, 1000) if t not in free), free


SEEDED = dict(temperature=0.9, seed=31)
AN_EMAIL = {"regex": "[a-z]{3,12}@[a-z]{3,8}\\.com"}


def test_a_thinking_budget_forces_the_after_token_at_its_end(client, exact, lm):
    """StructuredOutput.after_budget: a session that has written `budget` tokens without the after_token (a
    token this model does not write here) picks it next, then goes on free (any_text) or under its grammar.
    Fast bf16 and exact mode (mtp drafts) are token-identical to the exact engine's decode with the spec, greedy
    and seeded; budget 0 forces the first token (the prefill worker's pick), budget 6 one the decode worker
    picks; a budget alone takes ignore_eos."""
    from baton.loading import resolve_model_dir
    from baton.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model_dir(None))
    end, free = _no_token_written(lm)
    text = {"any_text": True}
    for budget, grammar, extra in [(0, AN_EMAIL, {}), (6, text, {}), (6, text, SEEDED), (6, AN_EMAIL, SEEDED)]:
        spec = {**grammar, "after_token": end, "after_budget": budget}
        want = exact(spec, 40, **extra)
        assert want[budget] == end, (budget, grammar, extra)
        if not extra:
            assert want[:budget] == free[:budget]
        for kw in (dict(engine="bf16"), dict(mode="exact", engine="mtp")):
            ids, _, last = run(client, n=40, structured=spec, **kw, **extra)
            assert ids == want, (budget, grammar, kw, extra)
            if "regex" in grammar:
                after = tok.decode(ids[budget + 1 :], skip_special_tokens=True)
                assert last.finish_reason == "EOS" and re.fullmatch(grammar["regex"], after), after
    spec = {**text, "after_token": end, "after_budget": 3}
    ids, _, last = run(client, n=30, structured=spec, engine="bf16", ignore_eos=True)
    assert len(ids) == 30 and ids[3] == end and last.finish_reason == "LENGTH"


def test_fast_mtp_takes_a_thinking_budget_alone(client, exact, lm):
    """A budget alone (any_text) on fast mtp: its free part in mtp rounds, its forced pick one masked plain
    round, then mtp rounds again: token-identical to the exact engine's decode with the spec (budget 0: the
    prefill's pick; 6: the decode worker's), greedy and seeded, and the same alone and among other mtp sessions."""
    end, _ = _no_token_written(lm)
    for budget, extra in ((0, {}), (6, {}), (6, SEEDED)):
        spec = {"any_text": True, "after_token": end, "after_budget": budget}
        want = exact(spec, 40, **extra)
        assert want[budget] == end and run(client, n=40, structured=spec, engine="mtp", **extra)[0] == want
    spec = {"any_text": True, "after_token": end, "after_budget": 3}
    jobs = [dict(structured=spec), dict(structured=spec, **SEEDED), dict(), dict(**SEEDED)]
    alone = [run(client, n=24, engine="mtp", **kw)[0] for kw in jobs]
    with ThreadPoolExecutor(len(jobs)) as ex:
        assert list(ex.map(lambda kw: run(client, n=24, engine="mtp", **kw)[0], jobs)) == alone
    assert alone[0][3] == alone[1][3] == end


def test_drafts_are_masked_only_in_rounds_the_grammar_can_bind(client, exact, lm, monkeypatch):
    """decode_worker/mtp.py binds: a thinking budget alone (any_text, 20 tokens) allows every token except at
    its end, so exact mode (mtp drafts, whose drafting keeps the session's Masker through its free part) writes
    draft masks (Masker.draft_row) only in the rounds whose drafts reach the budget's end: a few rounds, not
    one a round; the others draft unmasked (their chains on the device where there is one). The tokens are the
    exact engine's decode. (Fast mode runs a free part without its Masker: constrained.reasoning.)"""
    from baton import grammar

    rows, draft_row = [], grammar.Masker.draft_row

    def recording(self, start, toks):
        self.at(start, toks[0])
        rows.append((start, self.c.budget_left if self.c.free else -1))
        return draft_row(self, start, toks)

    monkeypatch.setattr(grammar.Masker, "draft_row", recording)
    end, _ = _no_token_written(lm)
    spec = {"any_text": True, "after_token": end, "after_budget": 20}
    want = exact(spec, 40)
    assert want[20] == end
    ids, _, last = run(client, n=40, structured=spec, mode="exact", engine="mtp")
    assert ids == want
    assert rows and all(0 <= left <= 14 for _, left in rows), rows  # only near the budget's end (K <= W - 2)
    assert len({start for start, _ in rows}) <= 3 < last.stats["rounds"], (rows, last.stats["rounds"])


def test_the_routers_thinking_budget_is_resolved_on_the_prompt(client):
    """SamplingParams.thinking_budget over gRPC: the router resolves it on the prompt (baton/sampling_rules.py
    think_budget). This model's prompt leaves no <think> open and its "</think>" is 5 tokens: no effect, the
    tokens are the plain request's, in fast and exact mode. Beside structured.after_budget: INVALID_ARGUMENT."""
    for kw in (dict(engine="bf16"), dict(engine="mtp"), dict(mode="exact", engine="mtp")):
        assert run(client, n=12, thinking_budget=2, **kw)[0] == run(client, n=12, **kw)[0], kw
    both = {"any_text": True, "after_token": 500, "after_budget": 3}
    with pytest.raises(grpc.RpcError) as ei:
        run(client, n=8, structured=both, thinking_budget=2)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith("sampling.thinking_budget: not with sampling.structured.after_budget")


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        (dict(ignore_eos=True), "sampling.structured: ends at EOS"),
        (dict(structured={"json_schema": "{not json"}), "sampling.structured.json_schema: not JSON"),
        (dict(structured={"regex": "(unclosed"}), "sampling.structured.regex: "),
        (dict(structured={"json_schema": {"type": 7}}), "sampling.structured.json_schema: "),
    ],
)
def test_refusals_name_the_field_and_the_next_request_is_served(client, kw, why):
    kw = {"structured": SPECS["choice"], **kw}
    with pytest.raises(grpc.RpcError) as ei:
        run(client, n=8, **kw)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
    assert ei.value.details().startswith(why), ei.value.details()
    assert follows("choice", run(client, structured=SPECS["choice"])[1])


def test_a_worker_that_cannot_compile_grammars_answers_failed_precondition(lm):
    """A prefill worker without grammars (a model without tokenizer.json, or xgrammar missing or broken):
    FAILED_PRECONDITION naming sampling.structured, relayed by the router; plain requests are still served."""
    from baton import grammar

    c, _, close = _cluster(lm)
    try:
        (p,) = close.prefills
        p.servicer.engine.grammars = grammar.none
        with pytest.raises(grpc.RpcError) as ei:
            run(c, n=8, structured=SPECS["choice"])
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION, ei.value.details()
        assert "sampling.structured: this worker's model has no tokenizer" in ei.value.details()
        assert len(run(c, n=4)[0]) >= 1
    finally:
        close()


def test_a_decode_worker_that_cannot_compile_grammars_drafts_unconstrained(lm, exact, caplog):
    """Exact mode beside a decode worker without grammars: its drafts go unconstrained (one warning naming the
    session), the prefill worker's Verify masks the rows, and the tokens are the exact constrained decode."""
    from baton import grammar

    c, (d,), close = _cluster(lm)
    try:
        d.servicer.engine.grammars = grammar.none
        with caplog.at_level("WARNING", logger="baton.decode"):
            ids, _, last = run(c, structured=SPECS["json_schema"], mode="exact", engine="mtp")
        assert ids == exact(SPECS["json_schema"], 48) and last.stats["drafted"] > 0
        assert any("drafts go unconstrained" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        close()


def test_fast_mtp_stops_a_round_at_a_natural_after_token(client, exact, lm):
    """A budget alone (any_text) on fast mtp whose after_token the model writes itself, before the budget: a
    speculative round whose accepted drafts run past it keeps only the tokens up to it (the verify's accept
    stops at a job's end token, speculation.accepted_length), so the session goes on from exactly there, and
    the tokens are the exact engine's decode with the spec (here the plain decode: nothing is forced or
    masked), for every switch point of the first 16 tokens."""
    from baton.complete import complete
    from baton.loading import resolve_model_dir
    from baton.tokenizer import Tokenizer

    free = complete(None, Tokenizer.from_dir(resolve_model_dir(None)).encode(PROMPT), 40, loaded=lm, max_len=MAX_LEN)
    switches = [i for i in range(2, 16) if free[i] not in free[:i]][:5]
    assert len(switches) == 5, free
    assert exact({"any_text": True, "after_token": free[switches[0]], "after_budget": 30}, 40) == free
    for at in switches:
        spec = {"any_text": True, "after_token": free[at], "after_budget": 30}
        assert run(client, n=40, structured=spec, engine="mtp")[0] == free, at
    for at in switches[:2]:  # exact mode's rounds (mtp drafts) across a natural after_token
        spec = {"any_text": True, "after_token": free[at], "after_budget": 30}
        assert run(client, n=40, structured=spec, engine="mtp", mode="exact")[0] == free, at
