"""The exact engine's per-session records (prefill_worker/engine.py ExactEngine): Session (its slot, times,
counters, the engine it was handed to, a re-prefill's replayed tail, prompt logprobs asked), Counters (exact
mode's drafted / accepted / blocks) and VerifyResult (one Verify's answer). A Session is made by
open_prefill and dropped at release or TTL expiry, its slot's state in the runner's HybridState."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Counters:
    drafted: int = 0
    accepted: int = 0
    rejected_blocks: int = 0
    verify_blocks: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class Session:
    id: str
    slot: int
    created: float
    last_used: float
    counters: Counters = field(default_factory=Counters)
    engine: int = 0  # decode engine (proto enum) the session was handed to; reused on migration
    replay: int = 0  # the prompt's last `replay` ids were generated: run_prefill feeds them as AR rows
    want_logprobs: int = -1  # open_prefill(prompt_logprobs=N >= 0): run_prefill fills prompt_logprobs (N alternatives)
    prompt_logprobs: list = field(default_factory=list)  # [(logprob, top)] of prompt tokens 1 .. n-1
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache, not computed (run_prefill)
    cache_salt: str = ""  # PrefillRequest.cache_salt: its prefix-cache keys start from it
    masker: object = None  # structured outputs: the grammar's masks on the slot (baton/grammar.py Masker)


@dataclass(frozen=True)
class VerifyResult:
    accepted: int
    next_token: int
    position: int
    counters: Counters
    logprobs: list = field(default_factory=list)  # SamplingTable.logprobs of d1..dm, next (when asked)
    hidden: object = None  # want_hidden: [m + 1, hidden] CPU tensor, the kept rows' final-normed hidden rows
