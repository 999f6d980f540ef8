"""Benchmark-only decode worker whose exact-mode drafts are right with a chosen probability p.

    python -m benchmarks.controlled_decode_worker --reference FILE [--draft-p 0.9] [--draft-seed 0] \\
        <any `python -m decode_worker` option: --random-init / --model, --device, --engines fp8, ...>

Random weights make real acceptance meaningless, so benchmarks/bench_exact.py measures exact mode with
this worker: the normal decode worker service (decode_worker.serve.serve_decode, same gRPC surface,
same CUDA graphs) with a ControlledDrafter (baton.engine.speculation.Drafter) passed in: the bf16/fp8
`draft` loop still runs every draft row on the model (k rows steps per Draft, as real drafting does), but
the drafter replaces each row's own greedy token:
    with probability p  the exact greedy token at that position (from the reference run),
    otherwise           a token that is not it (uniform over the rest of the vocabulary).
The replaced token is what the state consumes next (and what a verdict re-advances over), so the
worker's state stays consistent with what it proposed. Each proposal is an independent draw, so the
exact worker accepts m drafts of a block of k with P(m) = p^m (1 - p) for m < k and p^k for m = k.
MTP sessions are left alone (the hook is only in the bf16/fp8 loop).

FILE (JSON), read at every state load:
    {"references": [{"prompt_len": L, "tokens": [t0, t1, ...]}], "p": 0.9, "seed": 0}
tokens = the exact greedy output after a prompt of L tokens, first token t0 included (what the router
sends for it; bf16 AR gives the same tokens). A state loaded at position L with next token t0 is
controlled with that list; a state matching no reference is refused (INVALID_ARGUMENT on LoadState).
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
from dataclasses import dataclass
from pathlib import Path

from baton.engine.speculation import Drafter

log = logging.getLogger("baton.decode.controlled")


@dataclass
class _Ctl:
    base: int  # position of the loaded state (= prompt length)
    tokens: list[int]  # reference output, tokens[0] = the state's next token
    p: float
    rng: random.Random
    vocab: int
    idx0: int = 0  # reference index of draft 0 of the current Draft call


class Control:
    """The reference file, read again at every state load (a small file; one read per request)."""

    def __init__(self, path: str | Path, p: float, seed: int):
        self.path, self.p, self.seed = Path(path), p, seed

    def read(self) -> tuple[list[dict], float, int]:
        try:
            d = json.loads(self.path.read_text())
        except FileNotFoundError:
            raise ValueError(f"reference: {self.path} does not exist (the controlled worker needs it)") from None
        except (OSError, ValueError) as e:
            raise ValueError(f"reference: cannot read {self.path}: {e}") from None
        p, seed = float(d.get("p", self.p)), int(d.get("seed", self.seed))
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"reference: p={p} is not in [0, 1]")
        return list(d.get("references", [])), p, seed


class ControlledDrafter(Drafter):
    """Each session's drafts right with probability p, against its reference tokens (module doc)."""

    def __init__(self, control: Control):
        self.control = control
        self._loads = 0

    def attach(self, s, position: int, next_token: int) -> None:
        refs, p, seed = self.control.read()
        ref = next(
            (
                r["tokens"]
                for r in refs
                if int(r["prompt_len"]) == position and r["tokens"] and int(r["tokens"][0]) == next_token
            ),
            None,
        )
        if ref is None:
            raise ValueError(
                f"reference: none for a state at position {position} with next token {next_token} "
                f"in {self.control.path}"
            )
        j, self._loads = self._loads, self._loads + 1
        s.ctl = _Ctl(position, [int(t) for t in ref], p, random.Random(f"{seed}:{j}"), s.runner.cfg.vocab_size)
        log.info("controlled session %s: p=%.4f seed=%d #%d, %d reference tokens", s.id, p, seed, j, len(ref))

    def propose(self, s, i: int, own: int) -> int:
        c: _Ctl | None = getattr(s, "ctl", None)
        if c is None:
            return own
        if i == 0:  # bf16/fp8 drafts: the state has consumed t0 (one row); mtp drafts: nothing yet.
            # Reference index of d1 = tokens consumed after t0 = position - prompt length (+1 for mtp)
            c.idx0 = int(s.runner.state.position[s.slot]) - c.base + (s.engine == "mtp")
        idx = c.idx0 + i
        if idx >= len(c.tokens):
            return own
        want = c.tokens[idx]
        if c.rng.random() < c.p:
            return want
        return (want + 1 + c.rng.randrange(c.vocab - 1)) % c.vocab


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
