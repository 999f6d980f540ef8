"""Run under TRITON_INTERPRET=1 (tests/engine/test_pick_kernel.py): baton/kernels/pick.py, the CUDA token
pick, on CPU tensors (fp32 logits: the interpreter does not model bf16). Prints one JSON verdict line.

Checks: the kernel's hash is noise.uniform's; its token equals the torch sampler's (the CPU path of
baton/engine/sampling.py, the same cut semantics: whole tie groups) for temperature alone, top-k, top-p,
min-p, their combination, logits full of exact ties and greedy rows; a row's token is bitwise the same
alone and inside batches (row invariance); a top-p row whose first candidate is outside the nucleus takes
the loop (the candidates' passes), and still equals the torch pick."""

import json

import torch

import tests.interp_shim  # noqa: F401  (first: the interpreter's numpy fix)
import tests.launch_record as launch_record  # records each launch: compiled for sm_90 at the end
from baton.engine.noise import gumbel
from baton.engine.sampling import Params, SamplingTable, sample
from baton.kernels import pick as pk

pk.CHUNK, pk.BLOCK = 256, 128  # 3 chunks a row, 2 blocks a chunk (the GPU's 4096 would give one here)
torch.manual_seed(0)
V = 601  # not a multiple of the chunk or block: masked tails (the run's time grows with V: ~50 s at 601)
out = {}
cases = {
    "temperature": Params(temperature=0.8, seed=3),
    "top_p": Params(temperature=0.8, top_p=0.9, seed=4),
    "top_p_low": Params(temperature=1.0, top_p=0.3, seed=5),
    "top_k": Params(temperature=1.0, top_k=40, seed=6),
    "min_p": Params(temperature=0.7, min_p=0.05, seed=7),
    "all": Params(temperature=1.3, top_k=500, top_p=0.8, min_p=0.01, seed=2**40 + 9),
    "greedy": Params(),
}
S = len(cases)
table = SamplingTable(S, "cpu", 8, max_len=64)
for s, p in enumerate(cases.values()):
    table.set(s, p)
R = 4  # rows per case: positions 100..103
logits = torch.randn(S * R, V) * 3
logits[R : 2 * R, :300] = (logits[R : 2 * R, :300] * 2).round() / 2  # top_p rows: exact ties in half the row
slots = torch.arange(S).repeat_interleave(R)
positions = torch.arange(100, 100 + R).repeat(S)
ktok = pk.pick(logits, slots, positions, table)
ref = sample(logits, slots, positions, table, width=8)[0]
greedy_rows = slots == list(cases).index("greedy")
ktok = torch.where(greedy_rows, logits.argmax(-1), ktok)
for i, name in enumerate(cases):
    rows = slots == i
    out[f"equal_{name}"] = bool(torch.equal(ktok[rows], ref[rows]))
out["differs_by_seed"] = len(set(ktok[slots == 0].tolist())) > R // 2
# row invariance: each row alone, and inside another batch order
alone = torch.stack(
    [pk.pick(logits[i : i + 1], slots[i : i + 1], positions[i : i + 1], table)[0] for i in range(0, S * R, 5)]
)
out["row_invariant"] = bool(torch.equal(alone, pk.pick(logits, slots, positions, table)[0 : S * R : 5]))
perm = torch.randperm(S * R)
out["batch_order_invariant"] = bool(
    torch.equal(
        pk.pick(logits[perm], slots[perm], positions[perm], table), pk.pick(logits, slots, positions, table)[perm]
    )
)
# the loop: a row where the unrestricted Gumbel-max lands outside a small nucleus (top_p 0.3 of a flat row)
flat = torch.zeros(1, V)
flat[0, :3] = 7.0  # the three hold 52% of the mass: the first candidate is outside about half the time
t2 = SamplingTable(1, "cpu", 8, max_len=64)
hits = taken = 0
for pos in range(8):
    t2.set(0, Params(temperature=1.0, top_p=0.3, seed=pos))
    a = pk.pick(flat, torch.zeros(1, dtype=torch.long), torch.tensor([pos]), t2)
    b = sample(flat, torch.zeros(1, dtype=torch.long), torch.tensor([pos]), t2, width=8)[0]
    hits += int(torch.equal(a, b) and int(a) < 3)
    g = gumbel(t2.seed_hi[:1], t2.seed_lo[:1], torch.tensor([pos]), V)
    taken += int((flat + g).argmax() >= 3)  # the unrestricted Gumbel-max: outside the nucleus
out["loop_equal"] = hits == 8
# top_k=False (no row uses top-k: the radix launches skipped) gives the same tokens to rows without it
nok = slots != list(cases).index("top_k")
nok &= slots != list(cases).index("all")
out["skip_radix_same"] = bool(
    torch.equal(
        pk.pick(logits[nok], slots[nok], positions[nok], table, top_k=False),
        ktok[nok] * (slots[nok] != list(cases).index("greedy")),
    )
)
# the kernels read slots / positions element by element: an expanded (stride 0) slot column is the same
one = slots[R : R + 1].expand(R)
out["expanded_slots"] = bool(torch.equal(pk.pick(logits[R : 2 * R], one, positions[R : 2 * R], table), ktok[R : 2 * R]))
out["loop_taken"] = 1 <= taken <= 7
# a staircase: top-p 0.001 keeps token 0 alone; below it, groups of 4, 16, 64, 256 tokens, each a little
# lower and about 4x the mass of all above it, so a candidate climbs about one group per check and most rows
# take more candidates than the checks launched: they finish in _final's own loop
stair = torch.zeros(1, V)
stair[0, 0], stair[0, 1:5], stair[0, 5:21], stair[0, 21:85], stair[0, 85:341] = 10.0, 9.9, 9.8, 9.7, 9.6
chains, same = [], 0
for pos in range(6):
    t2.set(0, Params(temperature=1.0, top_p=0.001, seed=1000 + pos))
    a = pk.pick(stair, torch.zeros(1, dtype=torch.long), torch.tensor([pos]), t2)
    b = sample(stair, torch.zeros(1, dtype=torch.long), torch.tensor([pos]), t2, width=8)[0]
    same += int(torch.equal(a, b) and int(a) == 0)
    sc = stair[0] + gumbel(t2.seed_hi[:1], t2.seed_lo[:1], torch.tensor([pos]), V)[0]
    c, n = int(sc.argmax()), 1
    while c != 0:
        c, n = int(sc.masked_fill(stair[0] <= stair[0, c], -float("inf")).argmax()), n + 1
    chains.append(n)
out["fallback_equal"] = same == 6
out["fallback_taken"] = max(chains) > pk.CHECKS + 1
out["compiles_sm90"] = launch_record.compile_verdict()  # every launch above, compiled for sm_90
print(json.dumps(out))
