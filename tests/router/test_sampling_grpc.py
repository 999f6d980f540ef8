"""Sampling over real loopback gRPC (issue 22): a router, a prefill worker and a decode worker (bf16, fp8,
mtp) in this process on the embedded default model, checked against the exact engine's own seeded
decode (what `baton complete --temperature T --seed S` prints).

Validation (INVALID_ARGUMENT naming sampling.<field>); a seed gives the same tokens twice, alone and
among 7 concurrent other requests, in fast bf16 / fp8 / mtp; two seeds differ; T = 0 is greedy; exact
mode (fp8 and mtp drafts) and fast bf16 at T = 0.8 equal the exact engine's seeded decode; an unseeded
request reports its seed and replays with it; a stop string split across two tokens; held-back text
is released; logprobs equal a float64 log-softmax of the exact model's logits; a decode worker stopped
mid-stream: the re-prefilled session goes on with the same seeded tokens. Penalties (repetition, presence,
frequency): fast bf16 / mtp and exact fp8 / mtp give the exact engine's tokens with the same penalties,
greedy and at T = 0.8, also across a decode worker stopped mid-stream (fast re-prefill, exact ExportState).
"""

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from helpers import inprocess_cluster

from baton.engine.sampling import Params

MAX_LEN = 256
# router, prefill and decode workers on threads of this process: tiny ops on 2 cores, one torch thread
pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = ["def main(", "import json", "class Counter:", "for token in tokens:", "x", "@dataclass", "return [", "if "]


@pytest.fixture(scope="module")
def lm():
    from baton.loading import load_model

    return load_model(None, dtype="fp32", device="cpu", mtp=True)


def _cluster(lm, decodes: int = 1, prefills: int = 1):
    return inprocess_cluster(lm, MAX_LEN, decodes=decodes, prefills=prefills)


@pytest.fixture(scope="module")
def client(lm):
    c, _, close = _cluster(lm)
    yield c
    close()


@pytest.fixture(scope="module")
def exact(lm):
    """The exact engine the prefill worker runs, in process: the reference (`baton complete`)."""
    from baton.engine.runner import ModelRunner
    from baton.loading import resolve_model_dir
    from baton.tokenizer import Tokenizer
    from prefill_worker.engine import ExactEngine

    tok = Tokenizer.from_dir(resolve_model_dir(None))
    eng = ExactEngine(ModelRunner(lm.model, slots=1, max_len=MAX_LEN))

    @functools.cache  # deterministic: the tests ask for the same few references many times (Params is frozen)
    def ref(prompt, n, p):
        return tuple(eng.generate(tok.encode(prompt), n, sampling=p))

    return lambda prompt, n, p=None: list(ref(prompt, n, p))


def run(c, prompt="def main(", n=16, **kw):
    ids, text, lps, last = [], [], [], None
    for d in c.generate(prompt, max_new_tokens=n, ignore_eos=True, timeout=120, **kw):
        ids += d.token_ids
        text.append(d.text)
        lps += d.logprobs
        last = d
    return ids, text, lps, last


BAD = [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=101.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(min_p=2.0), "min_p"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=["s"] * 17), "stop"),
    (dict(stop=["é" * 129]), "stop[0]"),  # 258 bytes
    (dict(stop=["ok", ""]), "stop[1]"),
    (dict(repetition_penalty=11.0), "repetition_penalty"),
    (dict(repetition_penalty=-0.5), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(logit_bias={5: 101.0}), "logit_bias[5]"),
    (dict(logit_bias={5: float("nan")}), "logit_bias[5]"),
    (dict(logit_bias={10**7: 1.0}), "logit_bias"),  # past the vocabulary
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
    (dict(min_tokens=3), "min_tokens"),  # more than max_new_tokens (2)
]


def test_invalid_sampling_fields_are_named(client):
    for kw, field in BAD:
        with pytest.raises(grpc.RpcError) as ei:
            run(client, n=2, **kw)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (kw, ei.value.details())
        assert ei.value.details().startswith(f"sampling.{field}:"), (kw, ei.value.details())
    ok = run(client, n=2, temperature=100.0, top_p=1.0, min_p=1.0, logprobs=20, repetition_penalty=1.0, stop=["s"] * 16)
    assert len(ok[0]) >= 1
    edges = dict(repetition_penalty=10.0, presence_penalty=-2.0, frequency_penalty=2.0)  # the ranges' ends
    assert len(run(client, n=2, **edges)[0]) == 2


@pytest.mark.parametrize("engine", ["bf16", "fp8", "mtp"])
def test_a_seed_gives_the_same_tokens_twice_alone_and_among_7_others(client, engine):
    kw = dict(engine=engine, temperature=0.9, top_p=0.95)
    solo = {i: run(client, p, 12, seed=1000 + i, **kw)[0] for i, p in enumerate(PROMPTS)}
    assert run(client, PROMPTS[0], 12, seed=1000, **kw)[0] == solo[0]
    assert run(client, PROMPTS[0], 12, seed=1001, **kw)[0] != solo[0]  # another seed, other tokens
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        together = list(ex.map(lambda i: run(client, PROMPTS[i], 12, seed=1000 + i, **kw)[0], range(len(PROMPTS))))
    assert together == [solo[i] for i in range(len(PROMPTS))]
    greedy = run(client, PROMPTS[0], 12, engine=engine)[0]
    assert run(client, PROMPTS[0], 12, engine=engine, temperature=0.0, seed=5, top_k=3)[0] == greedy


@pytest.mark.parametrize(("mode", "engine"), [("exact", "fp8"), ("exact", "mtp"), ("fast", "bf16")])
def test_seeded_T08_equals_the_exact_engines_seeded_decode(client, exact, mode, engine):
    for seed in (7, 8):
        want = exact("class Counter:", 24, Params(temperature=0.8, seed=seed))
        ids, _, _, last = run(client, "class Counter:", 24, mode=mode, engine=engine, temperature=0.8, seed=seed)
        assert ids == want, (mode, engine, seed)
        assert last.stats["seed"] == seed
        if mode == "exact":
            assert 0 < last.stats["accepted"] <= last.stats["drafted"]


@pytest.mark.parametrize("engine", ["fp8", "mtp"])
def test_exact_rejection_policy_replays_a_seed_identically(client, engine):
    """The REJECTION policy (speculative rejection sampling, exact in distribution): a seeded exact-mode
    request gives the same tokens twice, alone and among 3 concurrent others; another seed differs. (A
    session of this policy must send each draft's q' with its Verify: the exact worker refuses one
    without, tests/prefill_worker/test_exact_engine.py, so these runs went through rejection sampling.)"""
    kw = dict(mode="exact", engine=engine, temperature=0.8, exact_policy="rejection")
    a, _, _, last = run(client, "class Counter:", 16, seed=21, **kw)
    assert len(a) == 16 and last.stats["seed"] == 21
    assert 0 < last.stats["accepted"] <= last.stats["drafted"]
    assert run(client, "class Counter:", 16, seed=21, **kw)[0] == a
    assert run(client, "class Counter:", 16, seed=22, **kw)[0] != a
    prompts = ["class Counter:", *PROMPTS[1:4]]
    with ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(lambda i: run(client, prompts[i], 16, seed=21 + 100 * i, **kw)[0], range(len(prompts))))
    assert together[0] == a


def test_exact_policy_is_validated(client):
    from baton.v1 import common_pb2, router_pb2

    req = router_pb2.GenerateRequest(text="x", max_new_tokens=2, mode=common_pb2.EXACT)
    req.sampling.temperature, req.sampling.exact_policy = 0.8, 7
    with pytest.raises(grpc.RpcError) as ei:
        list(client._stub.Generate(req, timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith("sampling.exact_policy:"), ei.value.details()
    with pytest.raises(ValueError, match="exact_policy"):
        run(client, n=2, exact_policy="maybe")


def test_an_unseeded_request_reports_its_seed_and_replays_with_it(client):
    a, _, _, last = run(client, temperature=1.0)
    seed = last.stats["seed"]
    b, _, _, last2 = run(client, temperature=1.0)
    assert last2.stats["seed"] != seed  # drawn per request
    assert run(client, temperature=1.0, seed=seed)[0] == a


def test_a_stop_string_split_across_two_tokens(client, exact):
    from baton.loading import resolve_model_dir
    from baton.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model_dir(None))
    kw = dict(temperature=0.8, seed=31)
    ids, text, _, _ = run(client, "def main(", 32, **kw)
    full = "".join(text)
    pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    # a boundary i | i+1 inside the text whose 2 + 2 characters around it occur first there
    cut = next(
        len(pieces[i])
        for i in range(3, len(ids) - 2)
        if len(pieces[i]) >= 2
        and len(pieces[i + 1]) >= len(pieces[i]) + 2
        and full.find(full[len(pieces[i]) - 2 : len(pieces[i]) + 2]) == len(pieces[i]) - 2
    )
    stop = full[cut - 2 : cut + 2]
    i_end = next(i for i, p in enumerate(pieces) if len(p) >= cut + 2)  # the token completing it
    got, gtext, _, last = run(client, "def main(", 32, stop=["never there", stop], **kw)
    assert "".join(gtext) == full[: cut - 2] and last.finish_reason == "STOP"
    assert got == ids[: i_end + 1] and last.usage["completion_tokens"] == i_end + 1
    # never completed: the held-back text reaches the client by the end, the output is whole
    got, gtext, _, last = run(client, "def main(", 32, stop=[stop + "\x00"], **kw)
    assert "".join(gtext) == full and got == ids and last.finish_reason == "LENGTH"
    sent = [len("".join(gtext[: j + 1])) for j in range(len(gtext))]
    assert any(s < len(pieces[j]) for j, s in enumerate(sent[:-1])), "nothing was ever held back"


def _ref_logprobs(lm, prompt_ids, out_ids, T):
    """float64 log_softmax(logits / T) of every generated token, from one wide pass over the sequence."""
    from baton.engine.state import HybridState
    from baton.models.qwen3_5 import StepContext

    seq = prompt_ids + out_ids
    st = HybridState(lm.cfg, slots=1, max_len=MAX_LEN, dtype=torch.float32, device="cpu", mtp=False)
    with torch.inference_mode():
        h = lm.model(torch.tensor(seq), st, StepContext(slot=0, width=None, n=len(seq), start=0))
        logits = lm.model.logits(h).double()
    lp = torch.log_softmax(logits / T, -1)[len(prompt_ids) - 1 : -1]  # row t predicts seq[t + 1]
    return lp


@pytest.mark.parametrize(("mode", "engine"), [("fast", "bf16"), ("exact", "fp8"), ("fast", "mtp")])
def test_logprobs_are_the_log_softmax_of_the_exact_logits(client, lm, mode, engine):
    from baton.loading import resolve_model_dir
    from baton.tokenizer import Tokenizer

    T, n = 0.9, 12
    prompt = Tokenizer.from_dir(resolve_model_dir(None)).encode("import json")
    ids, _, lps, _ = run(client, "import json", n, mode=mode, engine=engine, temperature=T, seed=4, logprobs=5)
    assert len(lps) == len(ids) == n and [t for t, _, _ in lps] == ids
    ref = _ref_logprobs(lm, prompt, ids, T)
    for j, (t, lp, top) in enumerate(lps):
        assert abs(lp - float(ref[j, t])) < 2e-4, (j, lp, float(ref[j, t]))
        want = torch.topk(ref[j], 5)
        assert len(top) == 5 and [a for a, _ in top][:3] == want.indices.tolist()[:3]
        assert all(abs(v - w) < 2e-4 for (_, v), w in zip(top, want.values.tolist()))


PEN = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.6)


@pytest.mark.parametrize(("mode", "engine"), [("fast", "bf16"), ("fast", "mtp"), ("exact", "fp8"), ("exact", "mtp")])
def test_penalties_give_exactly_the_exact_engines_tokens(client, exact, mode, engine):
    """Greedy and seeded T = 0.8 with all three penalties: exactly the exact engine's AR decode with the
    same penalties (`baton complete --repetition-penalty ...`); the penalties change that output."""
    for extra in (dict(), dict(temperature=0.8, seed=7)):
        want = exact("class Counter:", 24, Params(**PEN, **extra))
        assert want != exact("class Counter:", 24, Params(**extra)), extra  # so this test can fail
        ids, _, _, last = run(client, "class Counter:", 24, mode=mode, engine=engine, **PEN, **extra)
        assert ids == want, (mode, engine, extra)
        if mode == "exact":
            assert 0 < last.stats["accepted"] <= last.stats["drafted"]


@pytest.mark.parametrize(("mode", "engine"), [("fast", "bf16"), ("fast", "mtp"), ("exact", "fp8"), ("exact", "mtp")])
def test_logit_bias_gives_exactly_the_exact_engines_tokens(client, exact, mode, engine):
    """logit_bias (after the penalties, before the temperature), greedy and seeded T = 0.8, with penalties:
    exactly the exact engine's AR decode with the same bias; a +100 bias makes every greedy token that id."""
    from baton.loading import resolve_model_dir
    from baton.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model_dir(None))
    for extra in (dict(), dict(temperature=0.8, seed=7, **PEN)):
        plain = exact("class Counter:", 20, Params(**extra))
        bias = {plain[0]: -100.0, plain[1]: -100.0, tok.encode(" x")[0]: 3.0}  # its first tokens banned
        want = exact("class Counter:", 20, Params(logit_bias=tuple(sorted(bias.items())), **extra))
        assert want != plain, extra  # so this test can fail
        ids, _, _, last = run(client, "class Counter:", 20, mode=mode, engine=engine, logit_bias=bias, **extra)
        assert ids == want, (mode, engine, extra)
    forced = tok.encode(" x")[0]
    assert run(client, "class Counter:", 8, mode=mode, engine=engine, logit_bias={forced: 100.0})[0] == [forced] * 8


def test_penalties_with_the_rejection_policy_replay_a_seed(client):
    """REJECTION (exact in distribution): drafter and verifier both judge the penalized distributions; a
    seed replays identically, and the penalties change the tokens."""
    kw = dict(mode="exact", engine="fp8", temperature=0.8, seed=23, exact_policy="rejection")
    a, _, _, last = run(client, "class Counter:", 16, **kw, **PEN)
    assert len(a) == 16 and 0 < last.stats["accepted"] <= last.stats["drafted"]
    assert run(client, "class Counter:", 16, **kw, **PEN)[0] == a
    assert run(client, "class Counter:", 16, **kw)[0] != a


@pytest.mark.parametrize(("mode", "engine"), [("fast", "bf16"), ("exact", "fp8"), ("exact", "mtp")])
def test_penalties_survive_a_decode_worker_stopped_mid_stream(lm, exact, mode, engine):
    """Fast mode re-prefills prompt + sent tokens (generated_tokens: counted as generated), exact mode
    re-streams the exact state (ExportState; the router sends the exported position's tokens as the new
    worker's history): either way the tokens are the exact engine's with the same penalties. Exact mode
    with mtp drafts hands off draft-only states, the first and the migration's (Stats.draft_only_handoffs)."""
    c, ds, close = _cluster(lm, decodes=2)
    try:
        kw = dict(temperature=1.0, seed=78, **PEN)
        want = exact("def main(", 40, Params(**kw))
        got, stopped, last = [], threading.Event(), None
        for d in c.generate(
            "def main(", max_new_tokens=40, ignore_eos=True, timeout=120, mode=mode, engine=engine, **kw
        ):
            got += d.token_ids
            last = d
            if len(got) >= 6 and not stopped.is_set():
                busy = [h for h in ds if h.servicer.engine.session_count()]
                assert len(busy) == 1
                busy[0].stop(0)
                stopped.set()
        assert stopped.is_set() and got == want and last.stats["migrations"] == 1
        assert (last.stats["handoffs"], last.stats["draft_only_handoffs"]) == (2, 2 if engine == "mtp" else 0)
    finally:
        close()


@pytest.mark.parametrize("engine", ["fp8", "mtp"])
def test_penalties_and_a_seed_survive_the_exact_worker_stopped_mid_stream(lm, exact, engine):
    """Exact mode at T = 1.0 with penalties; the prefill worker holding the exact session is stopped mid-stream:
    the router re-prefills prompt + the tokens sent on the other one (generated_tokens: they count as
    generated, replayed as AR rows), and the tokens are the exact engine's with the same seed and penalties."""
    c, _, close = _cluster(lm, decodes=1, prefills=2)
    try:
        kw = dict(temperature=1.0, seed=79, **PEN)
        want = exact("def main(", 40, Params(**kw))
        got, stopped, last = [], False, None
        for d in c.generate(
            "def main(", max_new_tokens=40, ignore_eos=True, timeout=120, mode="exact", engine=engine, **kw
        ):
            got += d.token_ids
            last = d
            if len(got) >= 6 and not stopped:
                (busy,) = [h for h in close.prefills if h.servicer.engine.session_count()]
                busy.stop(0)
                stopped = True
        assert stopped and got == want and last.stats["migrations"] == 1
    finally:
        close()


def test_a_decode_worker_stopped_mid_stream_keeps_the_seeded_tokens(lm):
    c, ds, close = _cluster(lm, decodes=2)
    try:
        kw = dict(temperature=1.0, top_p=0.9, seed=77, engine="bf16")
        want = run(c, "def main(", 40, **kw)[0]
        got, stopped = [], threading.Event()
        for d in c.generate("def main(", max_new_tokens=40, ignore_eos=True, timeout=120, **kw):
            got += d.token_ids
            if len(got) >= 6 and not stopped.is_set():
                busy = [h for h in ds if h.servicer.engine.session_count()]
                assert len(busy) == 1
                busy[0].stop(0)  # its Decode stream breaks: the router re-prefills on the other worker
                stopped.set()
        assert stopped.is_set() and got == want
    finally:
        close()


def test_cli_generate_and_complete_take_the_sampling_flags(client, capsys):
    """`baton generate --temperature --top-p --seed --stop` over gRPC and `baton complete` in process with
    the same flags print the same tokens and text (the exact engine's seeded decode)."""
    import argparse
    import json

    from baton import client_cli, complete

    flags = ["--max-new-tokens", "20", "--temperature", "0.8", "--top-p", "0.95", "--seed", "5", "--json"]
    flags += ["--repetition-penalty", "1.2", "--presence-penalty", "0.3", "--frequency-penalty", "0.5"]
    p = argparse.ArgumentParser()
    complete.add_arguments(p)
    assert (
        complete.run(p.parse_args(["--prompt", "class Counter:", "--max-len", str(MAX_LEN), "--ignore-eos", *flags]))
        == 0
    )
    ref = json.loads(capsys.readouterr().out)
    g = argparse.ArgumentParser()
    client_cli.add_arguments_for("generate", g)
    args = g.parse_args(["--addr", client.addr, "--ignore-eos", *flags, "class Counter:"])
    assert client_cli.run_for("generate", args) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == ref["token_ids"] and got["text"] == ref["text"] and ref["seed"] == 5
    assert got["stats"]["seed"] == 5 and len(got["token_ids"]) == 20
    stop = ref["text"][4:7]
    args = g.parse_args(["--addr", client.addr, "--ignore-eos", *flags, "--stop", stop, "class Counter:"])
    assert client_cli.run_for("generate", args) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["text"] == ref["text"][: ref["text"].find(stop)] and cut["finish_reason"] == "STOP"
    bad = g.parse_args(["--addr", client.addr, "--temperature", "-1", "x"])
    assert client_cli.run_for("generate", bad) == 1
    assert "INVALID_ARGUMENT: sampling.temperature" in capsys.readouterr().err
    # --logit-bias ID=VALUE (repeatable): both print the same tokens, and a banned first token changes them
    biased = [*flags, "--logit-bias", f"{ref['token_ids'][0]}=-100", "--logit-bias", "7=2.5"]
    complete.run(p.parse_args(["--prompt", "class Counter:", "--max-len", str(MAX_LEN), "--ignore-eos", *biased]))
    ref_b = json.loads(capsys.readouterr().out)
    assert (
        client_cli.run_for("generate", g.parse_args(["--addr", client.addr, "--ignore-eos", *biased, "class Counter:"]))
        == 0
    )
    got_b = json.loads(capsys.readouterr().out)
    assert got_b["token_ids"] == ref_b["token_ids"] != ref["token_ids"]
    with pytest.raises(SystemExit):
        g.parse_args(["--logit-bias", "7", "x"])


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_prompt_logprobs_come_with_the_first_message(client, lm, mode):
    """GenerateRequest.prompt_logprobs N: the first message carries, for prompt tokens 1 .. n-1, each one's logprob
    given the tokens before it and N alternatives: the exact engine's prefill in this process computes the same
    values; only the first message has them; N over 20 is INVALID_ARGUMENT naming the field."""
    from baton.engine.runner import ModelRunner
    from baton.loading import resolve_model_dir
    from baton.tokenizer import Tokenizer
    from prefill_worker.engine import ExactEngine

    ids = Tokenizer.from_dir(resolve_model_dir(None)).encode("def fibonacci(n):")
    deltas = list(client.generate(ids, max_new_tokens=4, ignore_eos=True, mode=mode, prompt_logprobs=2, timeout=60))
    got = deltas[0].prompt_logprobs
    assert [t for t, _, _ in got] == ids[1:] and all(len(top) == 2 for _, _, top in got)
    assert all(not d.prompt_logprobs for d in deltas[1:])
    e = ExactEngine(ModelRunner(lm.model, slots=1, max_len=MAX_LEN))
    s = e.open_prefill(ids, prompt_logprobs=2)
    e.run_prefill(s, ids)
    for (_, v, top), (rv, rtop) in zip(got, s.prompt_logprobs):
        assert v == pytest.approx(rv, abs=1e-6) and [a for a, _ in top] == [a for a, _ in rtop]
    e.release(s.id)
    with pytest.raises(grpc.RpcError) as ei:
        list(client.generate(ids, max_new_tokens=2, prompt_logprobs=21, timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details().startswith("prompt_logprobs:")


@pytest.mark.parametrize(("mode", "engine"), [("fast", "bf16"), ("fast", "mtp"), ("exact", "fp8"), ("exact", "mtp")])
def test_min_tokens_holds_the_stop_ids_back_exactly_as_the_exact_engine(client, exact, mode, engine):
    """min_tokens m with a stop token id that the plain decode emits early: the first m tokens never hold it,
    and the tokens are exactly the exact engine's decode with that id banned below prompt + m (greedy and
    seeded T = 0.8), up to its first later occurrence, where the request stops (finish_reason STOP)."""
    from baton.loading import resolve_model_dir
    from baton.tokenizer import Tokenizer

    n_prompt = len(Tokenizer.from_dir(resolve_model_dir(None)).encode("class Counter:"))
    for extra in (dict(), dict(temperature=0.8, seed=7)):
        plain = exact("class Counter:", 24, Params(**extra))
        sid = plain[2]  # without min_tokens the request would stop at its third token
        ids, _, _, last = run(client, "class Counter:", 24, mode=mode, engine=engine, stop_token_ids=[sid], **extra)
        assert ids == plain[: plain.index(sid) + 1]  # so this test can fail
        want = exact("class Counter:", 24, Params(ban_end=n_prompt + 10, banned=(sid,), **extra))
        assert sid not in want[:10] and want[:10] != plain[:10]
        cut = want[: want.index(sid, 10) + 1] if sid in want[10:] else want
        kw = dict(mode=mode, engine=engine, stop_token_ids=[sid], min_tokens=10, **extra)
        ids, _, _, last = run(client, "class Counter:", 24, **kw)
        assert ids == cut, (mode, engine, extra)
        assert last.finish_reason == ("STOP" if sid in want[10:] else "LENGTH")


def test_min_tokens_workers_fields_are_the_routers_to_set(client):
    """min_tokens_end / min_tokens_ids are the workers' copy of min_tokens: a request that sets them is refused,
    naming the field."""
    from baton.v1 import common_pb2, router_pb2

    for field, value in (("min_tokens_end", 40), ("min_tokens_ids", [5])):
        sp = common_pb2.SamplingParams(**{field: value})
        req = router_pb2.GenerateRequest(text="x", max_new_tokens=4, sampling=sp)
        with pytest.raises(grpc.RpcError) as ei:
            list(client._stub.Generate(req, timeout=30))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details().startswith(f"sampling.{field}:"), ei.value.details()
