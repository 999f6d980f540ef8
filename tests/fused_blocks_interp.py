"""Runs the fused batched rows blocks (baton/engine/fused_blocks.py) on CPU through Triton's interpreter
(fp32) and prints a JSON verdict; tests/engine/test_fused_blocks.py runs this in a subprocess with
TRITON_INTERPRET=1.

  * rows: blocks of 3, 3, 2 and 3 rows of four slots (one seeded-sampled, one greedy with logprobs) in one
    rows_batch: each block's picks, hidden rows and its slot's whole state are bitwise those of
    rows(slot, tokens) alone on a runner without batching; a slot outside the batch is untouched;
  * verify: verify_blocks of four blocks on a runner with row checkpoints (the exact engine's), drafts
    right up to a different point in each block (all, one, none, none): each slot's (m, next), state
    and next token bitwise those of verify_block alone (the rewind of a cut block included);
  * mtp: decode_worker.mtp.chains of four sessions with 2, 2, 3 and 1 pending pairs and 2, 1, 2, 0
    drafts (0: no chain, the pairs kept; one seeded-sampled, one with logprobs): each session's drafts and MTP KV rows bitwise those
    of its chain alone (one group at a time through compute_mtp);
  * mtp_device: the same four sessions drafting 3, 1, 2 and 3 (the chain on the device, BatchedRows.mtp_chain),
    with the model's own drafts and with some drafts forced (Drafter.ahead): drafts and MTP KV rows
    bitwise each host-chained chain alone.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from types import SimpleNamespace  # noqa: E402

import interp_shim  # noqa: E402,F401  (before torch/triton kernels are traced)
import launch_record  # noqa: E402  (records each launch: compiled for sm_90 at the end)
import torch  # noqa: E402
from helpers import make_tiny_dir  # noqa: E402

from baton.engine import fast_rows  # noqa: E402
from baton.engine.fused_blocks import MAX_ROWS  # noqa: E402
from baton.engine.pages import kept_inputs_bytes_of  # noqa: E402
from baton.engine.runner import ModelRunner  # noqa: E402
from baton.engine.sampling import Params  # noqa: E402
from baton.engine.speculation import GREEDY, Drafter, verify_block, verify_blocks  # noqa: E402
from baton.kernels import gemv  # noqa: E402
from baton.loading import load_model  # noqa: E402
from decode_worker import drafting  # noqa: E402
from decode_worker.drafting import _ar_drafts  # noqa: E402
from decode_worker.mtp import CHAIN_ONE_ENV, chains  # noqa: E402

_rows_linear = fast_rows.rows_linear


def _gemv_rows_linear(mod, x, n, partial=False):
    """On CUDA every bf16 projection runs in the rows GEMM (gemv), whose rows are independent of M; this
    fp32 run does the same (torch's CPU linear is not row-invariant across M, and is not what CUDA runs)."""
    if type(mod) is torch.nn.Linear and not partial and mod.weight.dtype == x.dtype:
        return gemv.linear(x, mod.weight, rows=n)
    return _rows_linear(mod, x, n, partial)


fast_rows.rows_linear = _gemv_rows_linear

SLOTS = [3, 0, 4, 1]  # the batch's slots, not in order; slot 2 stays out
PARAMS = {3: Params(temperature=0.9, seed=11), 4: Params(logprobs=3)}


def _state(r: ModelRunner, slot: int) -> list[torch.Tensor]:
    st = r.state
    out = [st.conv[i][slot] for i in st.conv] + [st.recurrent[i][slot] for i in st.recurrent]
    p = int(st.position[slot])
    out += [x for i in st.attn_ids for x in st.slot_kv(i, slot, p)]
    return out + [st.position[slot : slot + 1], st.next_token[slot : slot + 1], st.hidden[slot]]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _runner(m, prompts, batching: bool, checkpoints: bool = False, fast: bool = True) -> ModelRunner:
    r = ModelRunner(m, slots=5, max_len=256, width=8, fast=fast, checkpoints=checkpoints)
    if batching:
        r.enable_batching()
    for slot, ids in prompts.items():
        r.prefill(slot, ids)
        if slot in PARAMS:
            r.sampling.set(slot, PARAMS[slot])
    return r


def main() -> None:
    global T0
    T0 = time.perf_counter()
    d = make_tiny_dir(Path(tempfile.mkdtemp()), seed=5, layers=4, hidden=64, vocab=512)
    m = load_model(d, dtype=torch.float32, device="cpu", mtp=True).model
    g = torch.Generator().manual_seed(0)
    prompts = {
        s: torch.randint(0, 512, (int(n),), generator=g).tolist() for s, n in zip(SLOTS + [2], (11, 5, 14, 8, 6))
    }
    out = {}

    # rows: one batched pass per block length, each block as it is alone
    lens = [3, 3, 2, 3]
    blocks = [(s, torch.randint(0, 512, (n,), generator=g).tolist()) for s, n in zip(SLOTS, lens)]
    batched = _runner(m, prompts, batching=True)
    before2 = [t.clone() for t in _state(batched, 2)]
    hid: list = []
    picks = batched.rows_batch(blocks, hidden_out=hid)
    alone = _runner(m, prompts, batching=False)
    ok, lp = True, True
    for (slot, toks), got, h in zip(blocks, picks, hid):
        ref = alone.rows(slot, toks)
        ok &= ref == got and torch.equal(alone.h_rows[: len(toks)], h)
        ok &= _same(_state(alone, slot), _state(batched, slot))
        if slot == 4:  # logprobs of the batched rows are the alone rows'
            lp = alone.sampling.logprobs(4, len(toks)) == batched.sampling.logprobs(4, len(toks))
    out["rows"] = {
        "equal": bool(ok),
        "logprobs_equal": bool(lp),
        "outside_untouched": _same(before2, _state(batched, 2)),
    }

    # verify: blocks cut at different points (the rewind), then one AR step of every slot
    ref_r = _runner(m, prompts, batching=False, checkpoints=True)
    bat_r = _runner(m, prompts, batching=True, checkpoints=True)
    vblocks = []
    for slot in SLOTS:
        t0 = int(ref_r.state.next_token[slot])
        vblocks.append((slot, [t0] + torch.randint(0, 512, (3,), generator=g).tolist()))
    # block 0's drafts all right (m = 3, no rewind), block 1's first one (m = 1): the probe feeds the blocks
    # (the eager path, not interpreted: it picks the fused path's tokens here, which `accepted` checks)
    probe = _runner(m, prompts, batching=False, fast=False)
    for b, right in ((0, 3), (1, 1)):
        slot, toks = vblocks[b]
        for i in range(right):
            toks[i + 1] = probe.rows(slot, [toks[i]])[0]
    res_b = verify_blocks(bat_r, vblocks)
    res_a = [verify_block(ref_r, s, toks) for s, toks in vblocks]
    ok = res_a == res_b
    for s in SLOTS:  # the whole state, next_token (the verdict's next) included
        ok &= _same(_state(ref_r, s), _state(bat_r, s))
    br = bat_r.batched_rows  # what the kept inputs take is what the workers' memory plans reserve
    kept = sum(t.numel() * t.element_size() for buf in br.saved.values() for t in buf) + br._z.numel() * 4
    counted = kept == kept_inputs_bytes_of(m.cfg, torch.float32, MAX_ROWS)
    out["verify"] = {"equal": bool(ok), "accepted": [m_ for m_, _ in res_b], "replays": br.replays, "counted": counted}

    # mtp: the chains of four sessions together == each chain alone
    def sessions(r):
        gen = torch.Generator().manual_seed(9)
        out_ = []
        for slot, n in zip(SLOTS, (2, 2, 3, 1)):
            p = int(r.state.position[slot])
            h = torch.randn(n, m.cfg.hidden_size, generator=gen)
            ids = torch.randint(0, 512, (n,), generator=gen).tolist()
            out_.append(
                SimpleNamespace(slot=slot, runner=r, mtp_pairs_h=h, mtp_pairs_ids=ids, mtp_start=p - n, mtp_h_more=[])
            )
        return out_

    eng = SimpleNamespace(drafter=GREEDY)
    ks = (2, 1, 2, 0)  # k = 0: no chain, the pairs kept (fast mode's plain round)
    mb = _runner(m, prompts, batching=True)
    got = chains(eng, list(zip(sessions(mb), ks)))
    ma = _runner(m, prompts, batching=False)
    want = [chains(eng, [(s, k)])[0] for s, k in zip(sessions(ma), ks)]
    L = ma.state.mtp_layer
    kv = all(
        _same(
            list(ma.state.slot_kv(L, s, int(ma.state.position[s]) + 3)),
            list(mb.state.slot_kv(L, s, int(mb.state.position[s]) + 3)),
        )
        for s in SLOTS
    )
    out["mtp"] = {
        "equal": got == want,
        "kv_equal": bool(kv),
        "drafts": [None if x is None else len(x) for x in got],
        "on_device": mb.batched_rows.device_chains,  # the three due sessions' chains (the fourth keeps its pairs)
    }

    # mtp on the device: the sessions drafting 3, 1, 2, 3 (BatchedRows.mtp_chain, one host read), with the model's
    # own drafts and with a drafter that forces some of them (Drafter.ahead), == each host-chained chain alone
    class Forced(Drafter):
        TABLE = {3: [None, 7, None], 0: [5, None, None], 4: [None, None, None], 1: [1, 2, 3]}

        def propose(self, s, i, own):
            v = self.TABLE[s.slot][i]
            return own if v is None else v

        def ahead(self, s, k):
            return list(self.TABLE[s.slot][:k])

    KS = (3, 1, 2, 3)  # each session its own k: a group done drafting runs junk rows in the later steps
    dev = {}
    # "rejection": slot 1 (3 drafts) drafts for exact mode's rejection policy (T 0.8): its picks record q'
    # by position, in every step of the chain
    reject = Params(temperature=0.8, seed=3, exact_policy=2)
    for name, drafter in (("own", GREEDY), ("forced", Forced()), ("rejection", GREEDY)):
        e = SimpleNamespace(drafter=drafter)
        mb = _runner(m, prompts, batching=True)
        ma = _runner(m, prompts, batching=False)
        if name == "rejection":
            for r_ in (mb, ma):
                r_.sampling.set(1, reject, proposing=True)
        got = chains(e, list(zip(sessions(mb), KS)))
        want = [chains(e, [(s, k)])[0] for s, k in zip(sessions(ma), KS)]
        kv = all(
            _same(
                list(ma.state.slot_kv(L, s, int(ma.state.position[s]) + 3)),
                list(mb.state.slot_kv(L, s, int(mb.state.position[s]) + 3)),
            )
            for s in SLOTS
        )
        if name == "forced":
            forced_got = got
        dev[name] = {"equal": got == want, "kv_equal": bool(kv), "on_device": mb.batched_rows.device_chains}
        if name == "rejection":  # the same q' recorded at the positions the batched passes pick (the alone
            # path's one-group passes, at width W, also record their junk rows' positions)
            qa, qb = ma.sampling.proposed.get(1, {}), mb.sampling.proposed.get(1, {})
            dev[name]["positions"] = sorted(qb)
            dev[name]["proposals_equal"] = (
                bool(qb) and set(qb) <= set(qa) and all(_same(list(qa[k]), list(qb[k])) for k in qb)
            )
    # a lone session's chain on the device (BATON_MTP_CHAIN_ONE=1), bitwise its host-chained steps
    os.environ[CHAIN_ONE_ENV] = "1"
    try:
        mb, ma = _runner(m, prompts, batching=True), _runner(m, prompts, batching=False)
        got, want = chains(eng, [(sessions(mb)[0], 3)]), chains(eng, [(sessions(ma)[0], 3)])
    finally:
        del os.environ[CHAIN_ONE_ENV]
    s0 = SLOTS[0]
    kv = _same(
        list(ma.state.slot_kv(L, s0, int(ma.state.position[s0]) + 3)),
        list(mb.state.slot_kv(L, s0, int(mb.state.position[s0]) + 3)),
    )
    dev["one"] = {"equal": got == want, "kv_equal": bool(kv), "on_device": mb.batched_rows.device_chains}
    dev["forced_kept"] = forced_got[0][1] == 7 and forced_got[1] == [5] and forced_got[3] == [1, 2, 3]
    dev["drafts"] = [len(x) for x in forced_got]
    out["mtp_device"] = dev

    # bf16 / fp8 drafts of exact mode (decode_worker/drafting.py _ar_drafts): on a batched runner the steps
    # launch ahead of their reads (_ar_pipelined), drafts of 3, 1, 2, 3, the model's own and forced; each
    # session's drafts and slot state == the step-by-step loop of that session alone
    ar = {}
    pipelined, piped = drafting._ar_pipelined, []  # counts the batched runs that took the pipelined path
    drafting._ar_pipelined = lambda *a: piped.append(pipelined(*a)) or piped[-1]
    for name, drafter in (("own", GREEDY), ("forced", Forced())):
        e = SimpleNamespace(drafter=drafter)
        res_, piped[:] = [], []
        for batching in (True, False):
            r_ = _runner(m, prompts, batching=batching)
            ss = [
                SimpleNamespace(slot=sl, runner=r_, engine="bf16", draft_t0=int(r_.state.next_token[sl]), drafts=[])
                for sl in SLOTS
            ]
            its = [(x, k, None) for x, k in zip(ss, KS)]
            if batching:
                outs = [None] * len(its)
                _ar_drafts(e, its, list(range(len(its))), outs)
            else:  # alone: one session at a time
                outs = []
                for it in its:
                    o1 = [None]
                    _ar_drafts(e, [it], [0], o1)
                    outs.append(o1[0])
            res_.append((outs, {sl: _state(r_, sl) for sl in SLOTS}))
        (got_b, st_b), (got_a, st_a) = res_
        ar[name] = {
            "equal": got_b == got_a,
            "state_equal": all(_same(st_a[sl], st_b[sl]) for sl in SLOTS),
            "pipelined": piped.count(True),  # the batched run's one runner; the alone runs have no batching
        }
    ar["forced_kept"] = got_b[0][1] == 7 and got_b[3] == [1, 2, 3]
    out["ar_drafts"] = ar
    out["seconds"] = round(time.perf_counter() - T0, 1)
    out["compiles_sm90"] = launch_record.compile_verdict()  # every launch above, compiled for sm_90
    print(json.dumps(out))


if __name__ == "__main__":
    main()
