"""Benchmark-only decode worker whose drafts are right with a chosen probability p.

    python -m benchmarks.controlled_decode_worker --reference FILE [--draft-p 0.9] [--draft-seed 0] \\
        <any `python -m decode_worker` option: --random-init / --model, --device, --engines fp8, --mtp-k 4, ...>

Random weights make real acceptance meaningless, so benchmarks/bench_exact.py and bench_serve.py
(--draft-p) measure speculation with this worker: the normal decode worker service
(decode_worker.serve.serve_decode, same gRPC surface, same CUDA graphs) with a ControlledDrafter
(baton.engine.speculation.Drafter) passed in. Every draft still runs on the model as real drafting does
(bf16 / fp8: k rows steps per Draft; mtp: the MTP head's chain, decode_worker/mtp.py `chains`), but the
drafter replaces each draft's own token:
    with probability p  the exact greedy token at that position (from the reference run),
    otherwise           a token that is not it (uniform over the rest of the vocabulary).
The replaced token is what the drafting state consumes next (and what a verdict re-advances over), so the
worker's state stays consistent with what it proposed. Each proposal is an independent draw, so the
verifier accepts m drafts of a block of k with P(m) = p^m (1 - p) for m < k and p^k for m = k: about
E = sum_{i=0..k} p^i tokens a round, accepted / drafted = sum_{i=1..k} p^i / k.
Where the hook runs (every engine.drafter.propose call):
    exact mode, bf16 / fp8 drafts   each Draft's k rows steps (decode_worker/drafting.py draft_batch)
    exact mode, mtp drafts          each Draft's MTP chain (mtp.chains), verified on the exact worker
    fast mode, mtp                  each round's MTP chain (mtp.rounds -> mtp.chains), verified here by the
                                    BF16 model: bitwise the exact engine's greedy tokens, so a draft is
                                    accepted iff it is the reference token, as in exact mode
    fast mode, bf16 / fp8           AR, nothing is drafted: uncontrolled (and unaffected)
Reference index of a round's d1: tokens the BF16 state consumed since the load (bf16 / fp8 drafting has
consumed t0 by the first draft, mtp nothing yet): position - prompt length, +1 for mtp.

FILE (JSON), read again at a state load whenever it changed (size or mtime):
    {"references": [{"prompt_len": L, "tokens": [t0, t1, ...]}], "p": 0.9, "seed": 0}
tokens = the exact greedy output after a prompt of L tokens, first token t0 included (what the router
sends for it; bf16 AR gives the same tokens). A state loaded at position L with next token t0 is
controlled with the references of that (L, t0); a state matching none is refused (INVALID_ARGUMENT on
LoadState). Several prompts may share (L, t0) (bench_serve's prompts all have one length): the session
keeps every such reference and, at each round, drops those that differ from the tokens verified so far
(the last round's accepted drafts and its pending token); it proposes from the first left. Where two
left references part, the draft at that position follows the first: wrong for the other's session
whatever the draw (one forced miss per parting, then the other is dropped).
"p" and "seed" in the file override --draft-p / --draft-seed, so one worker serves every p of a sweep.
Session number j (in load order) draws from random.Random(f"{seed}:{j}"): a sweep is repeatable.

Never imported by the production entry points (`baton serve`, `python -m decode_worker`, deploy/).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from baton.engine.speculation import Drafter

log = logging.getLogger("baton.decode.controlled")


@dataclass
class _Ctl:
    base: int  # position of the loaded state (= prompt length)
    refs: list[list[int]]  # the references still possible, tokens[0] = the state's next token; [0] is followed
    p: float
    rng: random.Random
    vocab: int
    idx0: int = 0  # reference index of draft 0 of the current round
    proposed: dict[int, int] = field(default_factory=dict)  # this round's drafts: reference index -> token
    judge_rng: random.Random | None = None  # ControlledDrafter.judge's own draws


class Control:
    """The reference file, read again at a state load when it changed (its size or mtime)."""

    def __init__(self, path: str | Path, p: float, seed: int):
        self.path, self.p, self.seed = Path(path), p, seed
        self._seen: tuple | None = None
        self._got: tuple[list[dict], float, int] | None = None

    def read(self) -> tuple[list[dict], float, int]:
        try:
            st = self.path.stat()
            key = (st.st_size, st.st_mtime_ns)
            if key == self._seen and self._got is not None:
                return self._got
            d = json.loads(self.path.read_text())
        except FileNotFoundError:
            raise ValueError(f"reference: {self.path} does not exist (the controlled worker needs it)") from None
        except (OSError, ValueError) as e:
            raise ValueError(f"reference: cannot read {self.path}: {e}") from None
        p, seed = float(d.get("p", self.p)), int(d.get("seed", self.seed))
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"reference: p={p} is not in [0, 1]")
        self._seen, self._got = key, (list(d.get("references", [])), p, seed)
        return self._got


def _round_start(s) -> tuple[int, int]:
    """(the BF16 state's position, the round's pending token t0) at a round's first draft. An mtp session
    keeps both on the host (decode_worker/mtp.py round_start: no device sync); bf16 / fp8 drafting has
    consumed t0 already (DecodeSession.draft_t0)."""
    if s.engine == "mtp" and getattr(s, "mtp_pairs_ids", None):
        from decode_worker.mtp import round_start

        return round_start(s)
    st = s.runner.state
    t0 = int(st.next_token[s.slot]) if s.engine == "mtp" else int(s.draft_t0)
    return int(st.position[s.slot]), t0


class ControlledDrafter(Drafter):
    """Each session's drafts right with probability p, against its reference tokens (module doc)."""

    def __init__(self, control: Control):
        self.control = control
        self._loads = 0

    def attach(self, s, position: int, next_token: int) -> None:
        refs, p, seed = self.control.read()
        match = [
            [int(t) for t in r["tokens"]]
            for r in refs
            if int(r["prompt_len"]) == position and r["tokens"] and int(r["tokens"][0]) == next_token
        ]
        if not match:
            raise ValueError(
                f"reference: none for a state at position {position} with next token {next_token} "
                f"in {self.control.path}"
            )
        distinct = list({tuple(r): r for r in match}.values())
        j, self._loads = self._loads, self._loads + 1
        s.ctl = _Ctl(position, distinct, p, random.Random(f"{seed}:{j}"), s.runner.cfg.vocab_size)
        log.info(
            "controlled session %s: p=%.4f seed=%d #%d, %d reference tokens, %d candidate reference(s)",
            s.id, p, seed, j, len(distinct[0]), len(distinct),
        )  # fmt: skip

    def _new_round(self, s, c: _Ctl, consumed: bool = True) -> None:
        """A round starts: d1 is at reference index idx0 (module doc); the last round's drafts before
        idx0 - 1 were accepted and t0 (at idx0 - 1) is the verified pending token: the references that
        disagree with them are dropped. consumed: the state's position is past t0 (propose's first call,
        after the first step; an mtp session's BF16 state consumes nothing), else one short of it (ahead)."""
        position, t0 = _round_start(s)
        position += not consumed
        c.idx0 = position - c.base + (s.engine == "mtp")
        known = {i: t for i, t in c.proposed.items() if i < c.idx0 - 1} | {c.idx0 - 1: t0}
        c.proposed = {}
        if len(c.refs) > 1:
            left = [r for r in c.refs if all(i < len(r) and r[i] == t for i, t in known.items())]
            if not left:
                log.warning("controlled session %s: no reference agrees with its verified tokens", s.id)
            c.refs = left

    def propose(self, s, i: int, own: int) -> int:
        c: _Ctl | None = getattr(s, "ctl", None)
        if c is None:
            return own
        if i == 0:
            self._new_round(s, c)
        idx = c.idx0 + i
        if not c.refs or idx >= len(c.refs[0]):
            return own
        want = c.refs[0][idx]
        if c.rng.random() < c.p:
            out = want
        else:
            out = (want + 1 + c.rng.randrange(c.vocab - 1)) % c.vocab
        c.proposed[idx] = out
        return out

    def ahead(self, s, k: int) -> list:
        """propose's k draws, made before the chain runs (they do not depend on the model's picks): the same
        draws in the same order, the same records; None where propose would return the model's own pick."""
        c: _Ctl | None = getattr(s, "ctl", None)
        if c is None:
            return [None] * k
        out: list = []
        for i in range(k):
            if i == 0:  # before the round's first step: a bf16 / fp8 state has not consumed t0 yet
                self._new_round(s, c, consumed=s.engine == "mtp")
            idx = c.idx0 + i
            if not c.refs or idx >= len(c.refs[0]):
                out.append(None)
                continue
            want = c.refs[0][idx]
            d = want if c.rng.random() < c.p else (want + 1 + c.rng.randrange(c.vocab - 1)) % c.vocab
            c.proposed[idx] = d
            out.append(d)
        return out

    def judge(self, s, own: int, actual: int) -> bool:
        """A first draft judged without a round (plain rounds' flush): right with probability p, as a
        proposed one is, from a generator of its own (propose's draws stay as they were)."""
        c: _Ctl | None = getattr(s, "ctl", None)
        if c is None:
            return own == actual
        if c.judge_rng is None:
            c.judge_rng = random.Random(f"judge:{c.base}:{c.p}")
        return c.judge_rng.random() < c.p


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.controlled_decode_worker", add_help=False, description=__doc__.split("\n")[0]
    )
    p.add_argument("--reference", required=True, help="JSON file of reference tokens (see the module doc)")
    p.add_argument("--draft-p", type=float, default=1.0, help="probability that a draft is the exact token")
    p.add_argument("--draft-seed", type=int, default=0, help="seed of the draws")
    a, rest = p.parse_known_args(argv)
    control = Control(a.reference, a.draft_p, a.draft_seed)

    from decode_worker import __main__ as worker_main

    return worker_main.main(rest, drafter=ControlledDrafter(control))


if __name__ == "__main__":
    from baton.worker.process import exit_process

    exit_process(main(sys.argv[1:]))
