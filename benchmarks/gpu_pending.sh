#!/usr/bin/env bash
# The GPU runs still owed by issues 20-22, one stage per device call (each under the device's 10 minutes).
#
#   bash benchmarks/gpu_pending.sh STAGE COMMIT        on the GPU machine, in the checkout's root
#
# The checkout must carry .gpu-wheels and .whl (../shared/device/stage.sh, bash deploy/gpu_wheels.sh).
# Every stage packs its logs and benchmark JSON into $OUT/STAGE.tgz (the device tool brings back 8 files at most).
# COMMIT is the commit under test (the device checkout has no .git), recorded by bench_serve.
# A device call ends at 600 s: if a tests stage runs out, run its files one call each (pytest -m gpu FILE).
# GPU_TEST_TIMEOUT: seconds a test may take, fixtures included (default 1200), so a hang fails one test.
#
# Run on 2026-12-01 (benchmarks/results/gpu-tests-h200-2026-12-01.md): every tests-* stage passed (at be31f43,
# tests-serving at cd86fee), serve, burst (without its per-pass log), spec-exact (mtp only, at be31f43; at
# cd86fee up to 8 streams). On 2026-12-02: tests-serving and tests-mtp at a3a234f (passed), burst with its
# per-pass log and profile (a3a234f, 8ecea85, c13286c), tests/engine/test_gpu_prefill.py at 8ecea85 (passed),
# serve at c13286c and bf16 top-p at 1 and 32 (README, Performance). Later on 2026-12-02
# (benchmarks/results/sampling-h200-2026-12-02.md): tests-engine, tests-decode, tests-serving at 7cd7cce (all
# passed); tests/engine/test_gpu_pick.py and test_gpu_batch.py -k sampled at b503664 (passed); sampling at
# b503664 (top-p / greedy 0.98x at 1 stream, 0.95x at 32; its serve JSON stayed behind: now packed). The
# evening of 2026-12-02 (benchmarks/results/gpu-h200-2026-12-02-119828c.md, gpu-h200-2026-12-02-later.md):
# tests-serving, tests-decode, burst, serve-steady, fp8, spec-fast at 119828c; spec-adaptive at e9216f8; at
# b082b20 / c04fef7 test_gpu_prefill.py (the fused conv's model-level bound failed at 0.02, now 0.05, not
# re-run), test_gpu_mtp_batch.py (passed), burst, spec-adaptive (its bf16 half cut by the call's limit).
# On 2026-12-03 (benchmarks/results/gpu-h200-2026-12-03.md): tests-mtp at ddbf95d (passed, with the pipelined
# plain rounds' test), spec-adaptive at 32 (ddbf95d, 343722f: 0.93x / 0.92x bf16), serve-steady at 343722f,
# tests/engine/test_gpu_prefill.py at b4774a0 (passed); tests-decode at b4774a0 (6 passes, summary cut by
# the timeout); tests-serving cut by its timeout with no log (now trapped: a cut stage packs its logs).
# Later on 2026-12-03 (benchmarks/results/gpu-h200-2026-12-03-ring.md): tests-serving at 9729775 (4 passed),
# test_gpu_batch.py + test_gpu_verify.py at 55a3371 (9 passed), serve-steady at 9729775 (the hand-off wait:
# 2.7 s p50 at 64 streams) and with BATON_HANDOFF_RING_SLOTS 32 / 128, long at 55a3371 (31 of 32: one
# request failed the router's 30 s stall check while queued; heartbeats since 83a6f6d).
# In the evening of 2026-12-03 (benchmarks/results/gpu-h200-2026-12-03-phases.md): serve-steady at eabbc65 and
# 0048ff6 (the step thread's phases: launch 57% at 64 streams, waiting for the GIL), long at eabbc65 (32 of
# 32), gil at 56257b1 (a shorter switch interval does not help), layout-fixed at 0048ff6.
# At night on 2026-12-03 (benchmarks/results/gpu-h200-2026-12-03-paced.md): tests-engine, tests-decode, paced,
# spec-adaptive (1, 8, 32) at ebe3754; layout-mixed at ebe3754 (every request RESOURCE_EXHAUSTED, cause not
# recorded; error_details and OUT.serve.log since) and again at 59e5217 (all completed); tests-mtp and
# spec-adaptive at 32 at 59e5217 (0.94x).
# On 2026-12-05 (benchmarks/results/gpu-h200-2026-12-05-nogil.md): tests-engine, tests-decode, tests-mtp at
# 1b233ec (13, 8, 3 passed), nogil at 64 streams (the launch phase 64% -> 1.7%, 2,888 -> 3,223 tok/s).
# Later on 2026-12-05, on an H100 (benchmarks/results/gpu-h100-2026-12-05-sampling.md): sampling at 1be5ff7
# (the one-GPU KV sizing race: 57 of 96 top-p requests refused at 32 streams), at eaf5f32 (the decode worker
# refused to start), and a greedy 32-stream check of 7820f0b's plan (64 of 64 served). Then owed, in order: nogil at 32 and again at 64, spec-adaptive
# (1, 8, 32) after d200d2d (what the round's host ops, 133 -> 13 a session on the CPU count, give), serve-steady
# (its decode_thread_cpu, a2cc26c: which threads hold the GIL on the GPU; its start-up runs a0adf61's
# KV-budget check on CUDA), burst, spec-exact (after 3af1f92, the batched Draft reads and d200d2d), verify,
# sampling (top-k after ec6ad29), gil with SWITCH_POINTS=5000,20000.
# On the evening of 2026-12-05, on an H100 (benchmarks/results/gpu-h100-2026-12-05-evening.md): sampling at
# 1e02dc4 (top-p / greedy 1.00x at 1, 1.02x at 32: issue 22's bound met), tests-engine at 1e02dc4 (12 passed;
# the 2 sampled-graph cases failed in the test's replay counter, fixed in 62b42d2: test_gpu_batch.py 7 passed,
# tests-mtp 3 passed), tests-serving at 1e02dc4 (4 passed), tests-decode at 8a4a653 (8 passed), spec-adaptive
# at 8a4a653 (K = 0 at 8 and 32, 0.947x bf16 at 32), spec-exact at 8a4a653 (2.83x at 8, 0.56x bf16 at 32),
# verify with --long 32000 (eager then; the bench captures the worker's graphs since).
# At night on 2026-12-05, on an H100 (benchmarks/results/gpu-h100-2026-12-05-night.md): spec-exact at 8b4ce9d
# (the round split: 188 ms at 32, ~3 batches of ~10; the leaders wait for the device), exact-passes at 3b8c698
# (a round's device parts alone: 62 ms for 32 sessions) and its pipelined runs. Every spec-* run until then had
# served exact mode with pipelined gathers: the controlled topology never set BATON_GPU_WORKERS (31d0f37).
# On 2026-12-06, on an H100 (benchmarks/results/gpu-h100-2026-12-06.md): spec-merged at 1412b3d (exact mode
# with the round barrier and the relayed hidden rows: 985 tok/s at 8, 1,571 at 32 = 0.68x bf16; its A/B half
# failed on --check-prompts 1) and spec-rows at f8e7dcf (the A/B: 1.11x at 8 and 32), tests-serving at
# 1412b3d (5 passed). Owed next: spec-merged VERDICT_AB=0 after 4a495bf (Verify passes grouped by the Draft
# round's tag), tests-mtp and tests-engine (MAX_ROWS 320's new (32, 9..10) graphs, the flush without a drain,
# test_gpu_prefill.py's concurrent re-prefills, test_gpu_verify.py's verify_batch), spec-adaptive at 32 (the
# undrained flush, 8e5f1e9), verify on the captured graphs, nogil at 32, serve-steady, burst, gil with
# SWITCH_POINTS=5000,20000.
# Later on 2026-12-06, on an H100 (benchmarks/results/gpu-h100-2026-12-06-gemv-table.md): sweep-rows at 384bca0
# (BLOCK_M / warps by M: gemv_config.TUNED_BATCH), test_gpu_batch.py (7 passed), test_gpu_verify.py (3),
# test_gemv.py (31) with the table, bench_exact_passes A/B of the table (verify at 8 sessions 11.29 -> 10.15 ms),
# and the xm orientation's sweep (bitwise; its table gemv_config.TUNED_BATCH_XM is off by default). Owed: tests-xm, spec-merged VERDICT_AB=0 after dbbf6d7
# (the draft-only hand-offs and the table), xm entries in TUNED_BATCH with test_gpu_batch.py and
# test_gpu_verify.py, and the rest owed above.
# Later on 2026-12-06, on three H100s (benchmarks/results/gpu-h100-2026-12-06-slim-xm.md): spec-merged
# VERDICT_AB=0 at 7996845 (exact 3.74x at 8, 0.87x bf16 at 32), tests-xm at 7996845 (7, 3, 31 passed; a round
# of 32 sessions 54.4 -> 51.9 ms: the xm table is on since ff5c4c1), slim-ab at 240b1ba (draft-only hand-offs
# 1.30x at 8, 1.22x at 32, on a host ~1.5x slower: exact mode is host-bound), test_gpu_mtp_batch.py,
# test_gpu_prefill.py, test_gpu_decode.py at 240b1ba (3, 6, 6 passed). Owed: spec-merged on an H200,
# tests-serving, test_gpu_batch.py / test_gpu_verify.py at the default table, and the rest owed above.
# Then batched at 8240ca8 on a fourth H100 (same report, section 5): exact mtp at 32 with the router's round
# batcher, 2,004 tok/s, round 91 ms, the leaders' waits 21.3 -> 5.4 / 7.3 -> 0.02 ms (across machines). Owed:
# its same-machine A/B: batched-ab (BATON_BATCHED_ROUNDS=0 against the default, with bf16 at 32).
# Later on 2026-12-06 (benchmarks/results/gpu-h100-2026-12-06-batched-ab.md): batched-ab, exact-passes and
# tests-serving at 47f8af1 on one H100 (batched / unary 0.98x at 8, 1.01x at 32; exact 0.91x bf16 at 32; 5
# passed), spec-merged at 47f8af1 on another (3.60x at 8, 0.88x at 32), ops at 1e093b9 (a Draft batch's host
# reads: 58-64 blocking copies, ~half its time). Owed next: tests-mtp and tests-serving after 407a62b (the MTP
# chains on the device, BatchedRows.mtp_chain), tests-engine and exact-fp8 after 3904b69 (the pipelined AR
# drafts), then spec-merged and ops there, spec-merged on an H200, and the rest owed above.
# The next session (benchmarks/results/gpu-h100-2026-12-06-tests-ops.md): tests-mtp, tests-serving, tests-engine,
# exact-fp8, spec-merged (VERDICT_AB=0: 3.68x at 8, 0.83x at 32) and ops at 20b6962 on one H100, all passed;
# slot-copies at c3e04fb (test_gpu_verify.py failed: inference-tensor index buffers, fixed in a136d2e; its
# 16-session case then passed; rewind 2.39 / 2.66 ms graph / eager at 8). Owed next, in order: tests-engine and
# tests-serving at HEAD (baton/kernels/copy_rows.py, the ("replay", (P, n)) graphs, the Verify's early output
# reads and the Draft batch's host-known pending tokens on the GPU: test_gpu_verify.py asserts the graphs ran),
# SLOT_SERVE=1 slot-copies, VERDICT_AB=0 spec-merged (its JSON now has ROLE_gathered_run_*_ms: where a
# served Verify / Draft batch's run goes, baton/engine/parts.py), prefill-sdpa (SDPA_SERVE=1), then the rest.
# Stop 48 (benchmarks/results/gpu-h100-2026-12-06-stop48.md): tests-engine (6, 7, 3 passed) and tests-serving (5)
# at cd31a99 on one H100: the slot copies, copy_rows, the replay graphs, the early reads pass. No machine could be
# started again that session. Owed, in order: prefetch-ab (the Draft sent ahead of a round's tokens, 2833ba5),
# SLOT_SERVE=1 slot-copies, VERDICT_AB=0 spec-merged, SDPA_SERVE=1 prefill-sdpa, then the rest owed above.
# Stop 49 (benchmarks/results/gpu-h100-2026-12-06-wide-tma.md), one H100 at cacce0a: wide-tma (the TMA loads bitwise
# the pointer kernel's), prefetch-ab (1.12x at 8, 1.11x at 32), spec-merged VERDICT_AB=0 (4.58x at 8, 1.03x bf16 at
# 32), SLOT_SERVE=1 slot-copies (1.08x at 8, 1.04x at 32; 3 passed), sweep_wide (tma_persistent 128 x 256: 0.90-1.02x
# cuBLAS from 2,048 rows); another H100 at 0258cca: wide-tma with the table (test_gpu_prefill.py 7 passed; 16 x 512
# 320 -> 256 ms). Owed, in order: WIDE_BURST=1 wide-tma and spec-merged at 0258cca or later (the table's TTFT and
# exact mode at 8), shared-prompt (da0b879: equal prompts computed once, its GPU test), serve-steady, burst,
# SDPA_SERVE=1 prefill-sdpa, spec-merged on an H200, then the rest above.
# Stop 50 (benchmarks/results/gpu-h100-2026-12-06-mps.md), one H100 at 28602a6 (a slower host: compare within it):
# spec-merged VERDICT_AB=0 (4.26x at 8, 0.94x bf16 at 32) and again with MPS=1 (4.70x, 0.99x; 1.085x plain at 32),
# shared-prompt (its GPU test passed; 8 equal x 512 136 ms against 145 distinct), spec-adaptive at 32 (0.94x, not
# K = 0 throughout), WIDE_BURST=1 wide-tma (burst of 32 first token p50 1.59 s with the table, 1.69 s without) and
# bench_ttft_burst at 8 (a pass beside its hand-off 387-458 ms, without 203-217 ms; MPS no help). Owed, in order:
# stage-ab (the staging by address, 2026-12-06), prefill-sdpa (cuDNN SDPA's host time: 1.3 ms a call, 64 calls a
# pass of 8), serve-steady, burst, spec-merged on an H200, then verify, nogil, gil above.
# Stop 51 (benchmarks/results/gpu-h200-2026-12-06.md), one H200 at 5672ba5: stage-ab (2 passed; burst of 32 first
# token p50 890 -> 715 ms by address: on by default since 92af9a2), spec-merged VERDICT_AB=0 (336 / 1,405 / 2,627
# tok/s: 4.18x at 8, 1.05x bf16 at 32), tests-engine (8, 7, 3 passed), shared-prompt (1 passed; 66.7 ms against
# 56.2 for one), burst (profiled), serve-steady (1,126 / 2,550 / 3,259 at 8 / 32 / 64), SDPA_SERVE=1 prefill-sdpa
# (8 passed; no decision), spec-adaptive at 32 (0.86x bf16). Owed, in order: stage-ab after ce7c515 (KV staged from
# its pages in place, BATON_STAGE_KV_IN_PLACE, off until then: AB_POINTS=1 BURSTS=32 is enough), prefill-sdpa-batch
# (equal-length first pieces in one SDPA call, BATON_PREFILL_SDPA_BATCH, off until then), SPEC_POINTS=32
# BF16_POINTS=none spec-adaptive after ce7c515 (the controller's median plain price, 2% probes; rounds by K), then
# verify, nogil, gil above.
# Stop 52 (benchmarks/results/gpu-h100-2026-12-06-stop52.md), one H100 (eight refused starts first, 901 s): MPS=1
# VERDICT_AB=0 MERGED_ADAPTIVE=1 spec-merged at 607785f (exact 4.57x at 8, 1.06x bf16 at 32; fast mtp 0.93x at
# K = 0, 15 speculative rounds of 58-131 ms), kv-ab (2 passed; in place the states landed 233 ms later: stays
# off), test_gpu_batch.py -k sampled (2 passed: logit_bias), test_gpu_prefill.py -k prompt_logprobs_at (its cut
# compared with the whole prompt's token: fixed, not re-run). Owed, in order: fla-bits, hold-ab, prefill-sdpa-batch, spec-adaptive
# at 32 without MPS on an H200, tests-engine, router-burst, mps-serve, ctx-max, then verify, nogil, gil above.
# Stop 53 (no device time: 91 s left at its start) added `queue`; the owed runs as four calls of one machine:
#   QUEUE="fla-bits:330 tests-engine:240" | QUEUE="hold-ab:400 router-burst:160" |
#   QUEUE="prefill-sdpa-batch:240 mps-serve:150 ctx-max:180" | QUEUE="accept-default:300 verify:250";
#   then commit the pins fla-bits wrote
# Stop 54 (benchmarks/results/gpu-h100-2026-12-07-stop54.md): 24 refused starts, then one H100 at 7e7aca8: fla-bits
# listed no autotuner (a detection bug, fixed in 1dacd36: run it again), structured failed (xgrammar did not import
# whole on the device: 'no attribute TokenizerInfo'). Owed: the four calls above (fla-bits first, then commit
# its pins), with structured after tests-engine in the first.
# Stop 55 (benchmarks/results/gpu-h100-2026-12-07.md), one H100 at dce08fe: fla-bits (no config changes the bits;
# H100 pins committed), test_gpu_prefill.py (10 passed, the flash batched-SDPA case failed: declined since),
# test_gpu_batch.py (7), test_gpu_verify.py (3), hold-ab (hold 0.80x, none 0.84x bf16 at 32: stays off),
# router-burst (first token p50 0.831 s), prefill-sdpa-batch (no gain: stays off), mps-serve (passed); structured
# failed on a missing pydantic (staged since), ctx-max did not fit the H100 (150,000 there since). Owed:
# QUEUE="prefix-cache:200 structured:200 accept-default:170" (the prefix cache since 2b1a657) |
# QUEUE="prefix-serve:400 tests-engine:190" (test_gpu_prefill.py: the cache's restore, equal later pieces) |
# QUEUE="ctx-max:300 verify:250" (ctx-max's 260,000 on an H200),
# SPEC_POINTS=32 BF16_POINTS=32 spec-adaptive on an H200, nogil at 32, gil SWITCH_POINTS=5000,20000.
# Stop 56 (benchmarks/results/gpu-h100-2026-12-07-stop56.md), H100s at d6286b1 .. 21ea4fe: structured (passed),
# accept-default (2.73 a round alone and batched), prefix-cache (1.8x / 3.3x, bitwise), prefix-serve (TTFT 0.144
# against 0.671 s at 1 stream; at 8 only 4 of 16 restored), test_gpu_prefill.py's cache and re-prefill cases (8
# passed), verify (8.7 / 28.6 ms beside a 32K prefill), spec-adaptive at 32 (0.90x), ctx-max at 150,000 (TTFT
# 1.97 s, after the KV sizing counted the attention's partials), window-ab (its halves on two hosts). Owed:
# QUEUE="tests-scratch:400 attn-loop:180" | WINDOW_LOOP=32 QUEUE="window-ab:420" (one host) |
# QUEUE="prefix-serve:400 ctx-max:180";
# ctx-max and spec-adaptive at 32 on an H200; prefix-serve again (the pool has room for the cache since 6a4bf81); nogil at 32; gil SWITCH_POINTS.
# Stop 57 (benchmarks/results/gpu-h100-2026-12-07-stop57.md), one H100 host at d550050 / c6a5a84: tests-scratch (13
# passed: the scratch on at every window since 31cb2c0), attn-loop (bitwise once the loop ran unpipelined, c6a5a84;
# the default since 31cb2c0), prefix-serve (16 of 16 restored at 8 streams: TTFT 0.974 against 1.495 s), ctx-max
# 150,000 (TTFT 1.94 s), window-ab with WINDOW_LOOP=32 (131K window 0.94x, looped 0.98x), spec-adaptive at 32
# (0.93x; first decode 125 / 46 ms, the worker's join 28 / 19 ms). At 31cb2c0 on another host: test_gpu_attention_loop.py,
# test_gpu_verify.py, test_gpu_mtp_batch.py passed; ctx-max cut by its 90 s while the checkpoint was written. Owed:
# PYTEST_FILES="tests/engine/test_gpu_batch.py tests/engine/test_gpu_prefill.py" QUEUE="pytest:330 ctx-max:200" (the
# looped default, one long row's 256 programs a (row, kv head); the prefix cache's in-pass restore, 3d84e66) |
# SPEC_POINTS=32 BF16_POINTS=32 QUEUE="spec-adaptive:300 tests-serving:280" (it prints the first decode's parts,
# decode_called / first_message, and the speculative rounds' log; a joining wave re-enters at K = 2 since 1158421) | QUEUE="partials-ab:420" (program partials: then
# on by default if bitwise and the ITL holds); ctx-max and spec-adaptive on an H200; nogil; gil.
# Stop 58 had no device time (32 s left at its start). It added cut-probe (QUEUE="cut-probe:150"): whether a prompt
# cut at page multiples keeps the whole prompt's state at the 9B shape (on the CPU it does at 256 / 512, not at
# 300): a prefix cache finer than 8,192-token pieces rests on it, and the prefill workers' --prefill-piece N now
# takes N only where its start-up check (the same comparison) passes. Owed: the stop-57 list above, then cut-probe,
# then (if it passes at 1024) PREFILL_PIECE=1024 QUEUE="prefix-serve:400".
# Stop 59 (benchmarks/results/gpu-h100-2026-12-07-stop59.md), one H100 at 78f9a55: spec-adaptive at 32 four times
# (fast mtp 0.86x / 0.71x bf16; BATON_MTP_FLUSH_LATER 1 / 0 runs 1,459 / 1,106 against 1,148 / 1,462 tok/s: runs
# of one configuration differ by 30% there, the A/B decides nothing), test_gpu_mtp_batch.py (3 passed),
# cut-probe (cuts at 256 / 1,024 / 2,048 change every state from layer 4 on: --prefill-piece keeps 8,192 on the
# GPU, prefix-serve with PREFILL_PIECE is moot), test_gpu_batch.py, test_gpu_prefill.py (7, 14 passed),
# tests-serving (5 passed). Owed, in order: QUEUE="spec-pairs:570" on one host (mtp and bf16 alternating twice:
# decode_setup_ms, the handler's part of a fast mtp call's 110-175 ms before its join), then on the same host
# BATON_MTP_CHAIN_ONE=1 QUEUE="spec-pairs:570" (a lone session's chain on the device: the dear 1-session
# speculative rounds beside the next wave's prefill; bitwise under the interpreter, test_fused_blocks.py) and
# BATON_MTP_JOIN_HOLD=2 QUEUE="spec-pairs:570" (no speculative round while states land: the wave's tail);
# BATON_PREFILL_ATTN=fixed QUEUE="cut-probe:150" (baton/kernels/causal_fixed.py: every piece's attention through
# one kernel whose rows do not depend on the piece's start), then BATON_PREFILL_ATTN=fixed PREFILL_PIECE=1024
# QUEUE="prefix-serve:400" and BATON_PREFILL_CUDNN_SDPA=0 QUEUE="cut-probe:150" (flash's SDPA for every piece); ctx-max (150,000 on an H100 at 31cb2c0 or
# later, 260,000 on an H200), spec-adaptive on an H200, partials-ab, nogil at 32, gil SWITCH_POINTS.
# Stop 60 (no device time: 105 s left) added a thinking budget (StructuredOutput.after_budget) to
# tests/system/test_gpu_structured.py, alone on bf16 and on fast mtp (its forced pick a masked plain round in
# the mtp rounds scheduler: run only on the CPU so far), and before a regex:
# PYTEST_FILES="tests/system/test_gpu_structured.py" QUEUE="pytest:300".
# Stop 61 got no machine (every start refused). It added per-stage settings to queue and spec-variants, and fast
# mtp under a grammar (masked verify rows, unconstrained drafts) to test_gpu_structured.py. Owed first, one call:
# PYTEST_FILES="tests/system/test_gpu_structured.py tests/engine/test_gpu_mtp_batch.py" QUEUE="pytest:300
# cut-probe:130:BATON_PREFILL_ATTN=fixed cut-probe:130:BATON_PREFILL_CUDNN_SDPA=0"; then QUEUE="spec-variants:570"
# and, on the same host, VARIANTS="mtp:BATON_MTP_JOIN_HOLD=2 mtp:BATON_MTP_CHAIN_ONE=1 mtp bf16"
# QUEUE="spec-variants:570" (the reverse order); then QUEUE="structured-mtp:300" and the rest owed at stop 59 above.
# Stop 62 got no machine either. It added each fast mtp session's own draft cap (baton/engine/draft_cap.py; A/B:
# BATON_MTP_OWN_CAPS=0), run by test_gpu_mtp_batch.py's rounds, and structured-mtp's mixed runs (own caps on/off).
# Stop 63 got no machine either (five refused starts, three "none is tried", then loans paused: 496 s of 1,800). It added exact mode's
# masked drafts (decode_worker/drafting.py) to structured-mtp, and the eager sampler's greedy shortcuts. Owed: the
# stop-61 list above, unchanged.
# On nvidia-h200-x2 (issue 25): layout-fixed and layout-mixed.
#
# Stages:
# MPS=1 (any stage): the stage's CUDA processes share one MPS server (both workers' kernels side by side on one GPU)
#   queue          QUEUE="STAGE:SECONDS[:VAR=V,...] ..." (e.g. "fla-bits:120 cut-probe:150:BATON_PREFILL_ATTN=fixed"):
#                  the stages in turn in one device call, each under its own timeout and packing its own STAGE.tgz
#                  (a stage given VAR=V settings has them alone and packs STAGE-N.tgz, N its place in QUEUE); one
#                  that no longer fits
#                  QUEUE_BUDGET_S (default 570) is skipped; queue.txt lists each one's exit code. Each device start
#                  costs minutes and a refused one 90-180 s, so a session spends its budget on a few queued calls
#                  (the device tool brings back 8 files a call: 7 stages at most)
#   cut-probe      benchmarks/probe_cut_invariance.py at the 9B shape: a 2,600-token prompt whole against cut at
#                  every CUT_GRAINS multiple (default 256,1024,2048,300): the tensors that differ
#   stage-ab       the hand-off's staging by address (BATON_STAGE_BY_ADDRESS 1 / 0): its GPU test, bursts at 8 and 32
#                  (on by default since 92af9a2; BURSTS, AB_POINTS="1" for the default alone)
#   kv-ab          the KV staged from its pages in place (BATON_STAGE_KV_IN_PLACE 1 / 0, by address on): its GPU
#                  test, bursts at BURSTS (AB_POINTS)
#   mps-serve      `baton serve --processes --device cuda --mps --ask`: the answer, the daemon, SIGTERM
#   router-burst   a burst of 32 x 512 through the router (bench_serve --requests 1): issue 20's TTFT target
#   ctx-max        one prompt near the whole context (LONG_INPUT, default 260,000) through the router
#   window-ab      short requests (512 + 128, bf16 at 32 streams) under a 4,296- and a 131,072-token window: the
#                  cost of the attention's programs over the whole window's pieces (WINDOW_LOOP=N: and looped)
#   attn-loop      the looped split attention's GPU test (bitwise the plain kernel), test_gpu_batch.py with it on
#   partials-ab    program partials (BATON_ATTN_PROGRAM_PARTIALS=32): their GPU test, one long prompt's ITL and the
#                  KV pages without and with (LONG_INPUT, default 100,000)
#   pytest         PYTEST_FILES="F ..." [PYTEST_K=EXPR]: chosen GPU tests, one process a file, wheels installed
#   tests-scratch  test_gpu_verify.py, test_gpu_batch.py, test_gpu_mtp_batch.py with BATON_ATTN_SCRATCH=1 (the
#                  attention's partials in one buffer a runner at every window: the default since 31cb2c0)
#   prefix-cache   the prefill worker's prefix cache (bench_prefix_cache.py): a follow-up turn's prompt of
#                  PREFIX_LENGTHS (default 16384,32768) tokens, its first pieces restored against computed (its first
#                  token and state bitwise the same)
#   prefix-serve   bench_serve with a 17,408-token shared prefix (a system prompt) + 2,048 own tokens, 64 new, at 1 and
#                  8 streams, with the prefill workers' prefix cache (default) and without (--prefix-cache 0): TTFT
#                  and cached_prompt_tokens
#   fla-bits       whether fla's autotuned configs change the delta rule's bits (each config held in turn, timed
#                  on a pass of 16 x 512); writes each kernel's fastest as pins ($out/fla-configs/GPU/) and runs
#                  tests/model/test_gpu_fla_pins.py with them (two processes, fresh Triton caches: same bits)
#   accept-default the embedded default model's MTP tokens per round at K = 3 alone and batched, on the GPU
#                  (acceptance_default_model.py --device cuda; CPU: 2.92, README)
#   hold-ab        fast mtp adaptive with the join hold (BATON_MTP_JOIN_HOLD 1 / 0) and bf16, at HOLD_POINTS
#   prefill-sdpa-batch  equal-length first pieces in one SDPA call (BATON_PREFILL_SDPA_BATCH 1 / 0): its GPU test,
#                  bursts at 8 and 32 (AB_POINTS, BURSTS)
#   shared-prompt  equal prompts in one prefill pass computed once: the GPU test, bench_shared_prompt at 8 x 512
#   wide-tma       the prefill GEMM (baton/kernels/wide.py) with TMA loads: sweep_wide (pointer / TMA loads x tiles,
#                  bitwise against the default), its GPU tests, profile_prefill with each (WIDE_BURST=1: TTFT bursts)
#   tests-xm       the rows GEMM's plain-orientation table (BATON_GEMV_XM=1): batch-invariance GPU tests, verify A/B
#   batched        exact mtp at 32 through the router's round batcher, short (one call of ~250 s)
#   batched-ab     exact mtp at 8 and 32 batched and unary (BATON_BATCHED_ROUNDS), bf16 at 32 (~450 s)
#   exact-fp8      exact mode with fp8 drafts (the pipelined AR drafts) at 1 and 8 streams, tokens checked
#   ops            exact mtp at 8, then 32, with torch.profiler over each worker's Draft / Verify batches
#                  (BATON_OP_PROFILE): their ops, kernels and device time against the batches' wall time
#   slim-ab        exact mtp at 8 and 32 with draft-only and with whole hand-offs (BATON_SLIM_HANDOFF), bf16 at 32
#   sweep-rows     benchmarks/sweep_rows_m.py: the rows GEMM's BLOCK_M / warps at M = 16..320, each variant
#                  checked bitwise against the M <= 16 kernel (SWEEP_MS, SWEEP_KINDS)
#   tests-engine   GPU tests never run on the H200 yet: batched prefill (causal_lower_right pieces),
#                  batched AR and the sampled batched graph ("arbs"), batched verify
#   tests-decode   decode (the step pipeline), the hand-off (dynamic ring share)
#   tests-mtp      batched MTP rounds: the chains' ("mtpb") and the verify's ("rowsb") graphs, ragged
#                  groups, adaptive K (tests/engine/test_gpu_mtp_batch.py)
#   structured     structured outputs on CUDA (tests/system/test_gpu_structured.py: the embedded model, 8 concurrent
#                  constrained and plain sessions = the exact constrained decode; xgrammar from .whl)
#   structured-mtp benchmarks/bench_structured_mtp.py on CUDA: fast mtp under a grammar against bf16 (tokens a
#                  round, decode tok/s, the tokens equal), and a plain + a json_object mtp request at once with
#                  each session's own draft cap on and off (BATON_MTP_OWN_CAPS=0; stop 62), and exact mode (mtp
#                  drafts) per grammar with its drafts masked by the grammar and unconstrained (stop 63)
#   tests-serving  the served stack (seeded exact mode at T 0.8, 16 exact sessions, sampled + greedy fast
#                  sessions together)
#   serve   bench_serve bf16 at 1, 8, 32, 64 streams (512/256), tokens checked
#   serve-steady   the same at 8, 32, 64 streams with 4 requests a stream, one after another (--requests 4):
#           the steady state of N streams, not one burst of N first tokens (issue 20's throughput targets)
#   fp8     bench_serve fp8 at 32 streams, and bf16 sampling (T 0.8, top-p 0.9, seeded) at 1 and 32 streams:
#           against the greedy `serve` stage, issue 22's 5% target; sampled tokens checked vs seeded complete
#   sampling   issue 22's bound in one call: bench_sampling (the sampler alone: greedy, top-p, one live row,
#           the sort's keys), then bf16 greedy and top-p 0.9 (T 0.8, seeded) at 1 and 32 streams,
#           SAMPLING_REQUESTS (default 3) requests a stream, and the ratios (target >= 0.95x)
#   nogil   serve-steady at 32 and 64 streams (NOGIL_STREAMS; one checked prompt) with the batched step's launch
#           through baton/engine/nogil.py, holding the GIL (BATON_NOGIL_LAUNCH=1), then through torch's calls (0)
#           (NOGIL_POINTS, default "1 0"): tok/s and decode_phase_share_launch against it
#   gil     serve-steady at 32 and 64 streams once per GIL switch interval of the workers
#           (BATON_SWITCH_INTERVAL_US; SWITCH_POINTS, default 5000,500,100 us): the step thread's launch phase
#           (decode_phase_share_launch) against the interval
#   paced   serve-steady at 32 and 64 streams (one checked prompt) once per Decode streams' message budget
#           (decode_worker/pacing.py; BATON_STREAM_MESSAGES_PER_S; PACE_POINTS, default 2000,0: 0 = off):
#           tok/s, tokens_per_message and the step thread's phases (decode_phase_share_launch) against it
#   long    bench_serve bf16, 32 streams at 16K context each (pages, not a 4,096 window)
#   verify  bench_verify_under_prefill: exact sessions' Verify latency beside a 32K prompt
#   burst   bench_ttft_burst: where a burst's TTFT goes (queue, pass, hand-off tail) at 1, 8, 32 x 512 (BURSTS),
#           each pass's wall time with the hand-off and without, and a profile of one burst of 32
#   layout-fixed, layout-mixed   issue 25's one-GPU half: bench_serve --layout both (split is recorded as
#           skipped on one GPU; on nvidia-h200-x2 both layouts run): fixed 512/256 at 1, 8, 32, 64, and
#           Poisson arrivals of mixed lengths with 10% 4K-16K prompts
#   spec-fast, spec-exact   issue 21 point 5, speculation through the router with the acceptance-controlled
#           drafter (bench_serve --draft-p: random weights make real drafts meaningless), 512/256:
#           spec-fast   fast mtp, each draft right with p = 0.9, K = 4, at 1, 8, 32 streams; fast bf16 at 32
#                       (target: fast mtp at 32 >= 1.3x fast bf16 at 32)
#           spec-exact  exact mode, mtp drafts right with p = 0.95, K = 8 (bench_exact's p = 0.95 K = 8), at 1,
#                       8 and 32 streams; fast bf16 at 32 (targets: exact at 8 >= 5x exact at 1, exact at 32
#                       >= 0.8x fast bf16 at 32)
#           spec-merged   spec-exact's exact runs (1, 8, 32), fast bf16 at 32, exact at 8 and 32 with the decode
#                       worker running the verdict rows (BATON_VERDICT_HIDDEN=0; VERDICT_AB=0 skips), and
#                       spec-adaptive's mtp run at 32 (MERGED_ADAPTIVE=1), in one call
#           prefill-sdpa   test_gpu_prefill.py and bench_ttft_burst with the prefill's attention off cuDNN SDPA
#                       (BATON_PREFILL_CUDNN_SDPA=0) against the default; SDPA_SERVE=1: exact mtp at 1 and 8 without
#           slot-copies   test_gpu_verify.py and bench_exact_passes' rewind A/B (the captured slot copies);
#                       SLOT_SERVE=1: exact mtp at 8 and 32 served with them and without (BATON_SLOT_COPIES=0)
#           exact-passes   an exact round's device parts at B = 1, 8, 16, 32 alone in one process
#                       (bench_exact_passes.py: the verify, verdict and chain passes, and a fast bf16 step), then
#                       spec-exact's runs at 8 and 32 with the gathers pipelined (BATON_GATHER_PERIODIC=0)
#           spec-adaptive   fast mtp as spec-fast, K chosen by the decode worker's controller from the prior 4
#                       (--mtp-draft-length adaptive; K = 0, plain steps, when drafts do not pay at the batch),
#                       and fast bf16, at 1, 8, 32 streams (target: >= 1.3x bf16 at 32, or K = 0 there and
#                       within 5% of bf16; the speculation kept where it pays, at 1 stream). SPEC_POINTS /
#                       BF16_POINTS: other concurrencies (a ratio needs both runs at that N)
#           spec-variants  the same at PAIR_N (default 32) only, one run per VARIANTS entry on one host (e.g.
#                       "mtp bf16 mtp bf16"; stop 59's spec-pairs): each mtp run over the bf16 runs' median
#           Fewer prompts than streams: --draft-p needs every prompt's `baton complete` reference, and the
#           exact engine took ~30 s per 256-token reference of the 9B on the H200 (the serve stage's
#           prepare: 60 s for 2), so 32 distinct prompts would not fit one 600 s call; 2 distinct prompts
#           (each shared by N/2 streams; the controlled draws do not depend on the tokens, each session
#           draws its own), the same 2 in the bf16 run. Estimated per stage: ~3 min the speculating run
#           (checkpoint with the MTP head, 2 references, boot, points), ~2 min the bf16 run.
set -uo pipefail
stage=${1:?stage: tests-engine|tests-decode|tests-mtp|tests-serving|serve|serve-steady|nogil|gil|paced|fp8|sampling|long|verify|burst|layout-fixed|layout-mixed|spec-fast|spec-adaptive|spec-exact|spec-merged|prefetch-ab|slot-copies|prefill-sdpa|prefill-sdpa-batch|wide-tma|shared-prompt|stage-ab|... (the Stages list above)}
commit=${2:?the commit under test}
dest=${OUT:?run through the device tool: \$OUT}
if [ "$stage" = queue ]; then  # QUEUE="STAGE:SECONDS ...": one device call, several stages (Stages, queue)
  start=$SECONDS n=0
  for item in ${QUEUE:?queue: set QUEUE=\"STAGE:SECONDS[:VAR=V,...] ...\"}; do
    IFS=: read -r s t envs <<<"$item"
    left=$((${QUEUE_BUDGET_S:-570} - (SECONDS - start)))
    if [ "$t" -gt "$left" ]; then
      echo "queue: $s skipped: $t s asked, $left s left"
      continue
    fi
    # a stage's own settings (VAR=V,VAR=V after its seconds) apply to it alone: A/Bs of one host in one call
    IFS=, read -r -a vars <<<"${envs:-}"
    n=$((n + 1))
    env ${envs:+QUEUE_TAG=$n} "${vars[@]}" timeout -k 10 "$t" bash "$0" "$s" "$commit" </dev/null
    echo "queue: $s${envs:+ ($envs)} rc=$? at $((SECONDS - start)) s"
  done 2>&1 | tee "$dest/queue.txt"
  exit 0
fi
# the device tool brings back at most 8 files from $OUT: a stage writes into its own folder, packed into one
# $OUT/STAGE.tgz when it ends (on 2026-12-02 the sampling stage's serve JSON stayed behind: 9 files)
out=$(mktemp -d "/tmp/gpu-$stage-XXXX")
trap 'mps_stop; tar -czf "$dest/$stage${QUEUE_TAG:+-$QUEUE_TAG}.tgz" -C "$out" .' EXIT
# MPS=1: every CUDA process of the stage shares one MPS server (nvidia-cuda-mps-control), so the two workers on
# one GPU run their kernels side by side instead of in time slices of their own contexts. The daemon is this
# stage's (its pipe and log folders in $out) and stops when the stage ends; the GPU's settings are untouched.
mps_stop() {
  if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
    echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
    echo "mps: stopped" >>"$out/mps.txt"
  fi
}
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mps-pipe-XXXX) CUDA_MPS_LOG_DIRECTORY="$out/mps-log"
  mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d >>"$out/mps.txt" 2>&1 &&
    python -c "import torch; torch.ones(1, device='cuda').sum().item()" >>"$out/mps.txt" 2>&1; then
    echo "mps: started" | tee -a "$out/mps.txt"
  else  # no daemon, or a client that cannot reach its server: the stage runs without MPS
    echo "mps: could not start (see mps.txt): running without MPS" | tee -a "$out/mps.txt"
    mps_stop
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi
# a stage cut by `timeout` (SIGTERM to its process group) still packs what it logged: without this trap bash
# dies on the signal without running the EXIT trap (on 2026-12-03 a cut tests-serving left nothing behind)
trap 'echo "$stage: stopped by a signal (timeout?)" | tee -a "$out/stopped.txt"; exit 124' TERM INT
bash .gpu-wheels/install.sh >/dev/null 2>&1
bash .whl/install.sh >/dev/null 2>&1
export PYTHONPATH="$PWD:/tmp/gpu-site:${PYTHONPATH:-}"
nvidia-smi -L >"$out/gpus.txt" 2>&1
burst_ab() {  # VAR, NAME: bench_ttft_burst (--prefill-process: the prefill worker in its own process, as deployed,
  # no benchmark thread sharing its GIL) once with VAR set to each of AB_POINTS (default "1 0"), at BURSTS (8,32),
  # into $out/ttft-burst-NAME$value.json, and each burst's first token p50 and passes printed
  local var=$1 name=$2 v
  for v in ${AB_POINTS:-1 0}; do
    env "$var=$v" python benchmarks/bench_ttft_burst.py --random-init qwen3.5-9b --device cuda --prompt 512 \
      --bursts "${BURSTS:-8,32}" --prefill-process --out "$out/ttft-burst-$name$v.json" >"$out/ttft-burst-$name$v.log" 2>&1
    echo "burst $var=$v: rc=$?"
    python - "$out/ttft-burst-$name$v.json" <<'EOF'
import json, sys

try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(0)
for r in d["results"]:
    print(f"  burst {r['burst']}: first p50 {r['first_ms'].get('p50')} ms; passes beside the hand-off "
          f"{[[p['ms'] for p in b] for b in r['passes']]}, plain {[[p['ms'] for p in b] for b in r['plain_passes']]}")
EOF
  done
}

serve() {  # name, then bench_serve arguments
  local name=$1
  shift
  python benchmarks/bench_serve.py --device cuda --random-init qwen3.5-9b --no-hf --warmup 1 --check-prompts 2 \
    --commit "$commit" --no-plot --out "$out/$name.json" "$@" >"$out/$name.log" 2>&1
  echo "$name: rc=$?"
}
ratio() {  # label, JSON A, N of A, JSON B, N of B, target: tok/s of A's point over B's
  python - "$@" <<'EOF'
import json, sys

label, fa, na, fb, nb, target = sys.argv[1:]


def point(f, n):
    try:
        return next(p for p in json.load(open(f))["points"] if p.get("concurrency") == int(n))
    except (OSError, ValueError, KeyError, StopIteration):
        return {}


pa, pb = point(fa, na), point(fb, nb)
a, b = pa.get("tok_s"), pb.get("tok_s")
r = round(a / b, 2) if a and b else None
errors = {k: v for k, v in (("A", pa.get("errors")), ("B", pb.get("errors"))) if v}
note = f" NOT COMPARABLE, failed requests: {errors}" if errors else ""
print(f"{label}: {a} / {b} tok/s = {r}x (target >= {target}x){note}")
EOF
}
spec_parts() {  # bench_serve JSONs: per point, fast mtp's rounds by K and speculative rounds, and the first decode in
  # its parts (call_waits.py), TTFT and hand-off
  python - "$@" <<'EOF' 2>/dev/null
import json, sys

for f in sys.argv[1:]:
    try:
        points = json.load(open(f))["points"]
    except OSError:
        continue
    for p in points:
        e, n = p["engine"], p["concurrency"]
        if e == "mtp":
            print(f"  mtp at {n}: rounds by K {p.get('mtp_rounds_by_k')}, ms {p.get('mtp_round_ms_by_k')}")
            spec = p.get("mtp_spec_rounds", [])  # [round, K, sessions, ms, probe]
            print(f"    speculative rounds [round, K, sessions, ms, probe]: {spec[:24]}")
        # the first decode (state landed -> first decode tokens at the router) in its parts (call_waits.py)
        print(f"  {e} at {n}: first decode {p.get('first_decode_ms_p50')} ms p50 = LoadState -> Decode "
              f"{p.get('decode_called_ms_p50')} + Decode -> first message {p.get('decode_first_message_ms_p50')} "
              f"(of it the handler's set-up {p.get('decode_setup_ms_p50')}, the join {p.get('decode_first_tokens_ms_p50')}"
              f", prefill passes {p.get('prefill_passes')} of {p.get('prefill_pass_mean_pieces')} pieces) + back to the router; TTFT "
              f"{p.get('ttft_s_p50')} s, hand-off {p.get('router_handoff_ms_p50')} ms")
EOF
}
rounds() {  # JSON: per point, the round and where each worker's gathered batch run went (baton/engine/parts.py)
  python - "$1" <<'EOF'
import json, sys

try:
    points = json.load(open(sys.argv[1]))["points"]
except (OSError, ValueError, KeyError):
    points = []
for p in points:
    parts = {
        role: " ".join(
            f"{k[len(role) + 14 : -3]} {v}"
            for k, v in sorted(p.items())
            if k.startswith(f"{role}_gathered_run_") and k != f"{role}_gathered_run_ms"
        )
        for role in ("decode", "prefill")
    }
    print(
        f"at {p.get('concurrency')}: round {p.get('round_ms_p50')} ms (draft {p.get('round_draft_ms_p50')}, verify "
        f"{p.get('round_verify_ms_p50')}); decode batch wait {p.get('decode_gathered_wait_ms')} run "
        f"{p.get('decode_gathered_run_ms')} [{parts['decode']}]; prefill lock {p.get('prefill_gathered_lock_ms')} "
        f"run {p.get('prefill_gathered_run_ms')} [{parts['prefill']}]"
    )
EOF
}
spec() {  # name, then bench_serve arguments: 512/256 (the cuda defaults), 2 prompts, warm-up at 1 and 8
  # The decode worker offers bf16 and mtp only (no FP8 copy, ~9 GB at the 9B shape): with all three engines on
  # an H100 (80 GB, both workers on it) the mtp worker was left 1 KV page and refused to start (2026-12-05)
  local name=$1
  shift
  # SPEC_REQUESTS a stream (default 3): one burst a point left fast mtp at 32 at 0.947x bf16 on the H100
  # (2026-12-05), inside the ~5-10% that one burst varies run to run; three give the steady state
  serve "$name" --prompts 2 --warmup 1,8 --requests "${SPEC_REQUESTS:-3}" --serve-args "--engines bf16,mtp" "$@"
}
case $stage in
  pytest)  # PYTEST_FILES (space-separated), PYTEST_K (pytest -k, optional): GPU tests of one's choice, one process a
    # file, with the staged wheels installed (run outside the queue, a test that opens a gRPC server found no
    # grpc_health on 2026-12-07)
    rc=0
    for f in ${PYTEST_FILES:?pytest: set PYTEST_FILES}; do
      python -m pytest -o addopts="" -m gpu -q -rfE --timeout "${GPU_TEST_TIMEOUT:-1200}" ${PYTEST_K:+-k "$PYTEST_K"} \
        "$f" >>"$out/pytest.log" 2>&1 || rc=1
      echo "$f: $(tail -1 "$out/pytest.log")"
    done
    grep -E "^(FAILED|ERROR|E  )" "$out/pytest.log" | head -20
    echo "pytest: rc=$rc"
    ;;
  tests-engine | tests-decode | tests-mtp | tests-serving | tests-scratch | structured)
    case $stage in
      tests-mtp) files="tests/engine/test_gpu_mtp_batch.py" ;;
      tests-scratch)  # the attention's partials in one buffer a runner at every window (split_scratch.py)
        export BATON_ATTN_SCRATCH=1
        files="tests/engine/test_gpu_verify.py tests/engine/test_gpu_batch.py tests/engine/test_gpu_mtp_batch.py" ;;
      structured) files="tests/system/test_gpu_structured.py" ;;
      tests-engine) files="tests/engine/test_gpu_prefill.py tests/engine/test_gpu_batch.py tests/engine/test_gpu_verify.py" ;;
      tests-decode) files="tests/engine/test_gpu_decode.py tests/handoff/test_handoff.py" ;;
      *) files="tests/system/test_gpu_serving.py" ;;
    esac
    # one pytest process a file: on an H100 (80 GB) test_gpu_verify.py's 9B fixtures ran out of memory in the
    # process test_gpu_batch.py's had run in (2026-12-06), while each file alone passed
    rc=0
    if [ "$stage" = structured ]; then  # stop 54: xgrammar imported without TokenizerInfo here; record why
      { bash .whl/install.sh; echo "install rc=$?"; ls /tmp/gpu-site | grep -iE 'xgr|tvm'
        pip list 2>/dev/null | grep -iE 'xgrammar|tvm|pydantic|numpy|transformers|torch|triton'
        python -c "import sys; print(sys.path)"
        python -c "import xgrammar as x; print(x.__file__, getattr(x, '__version__', None), hasattr(x, 'TokenizerInfo'))"
        python -c "import xgrammar.base" ; python -c "from xgrammar.tokenizer_info import TokenizerInfo"
      } >"$out/xgrammar.txt" 2>&1
      cat "$out/xgrammar.txt" | tail -20
    fi
    for f in $files; do
      python -m pytest -o addopts="" -m gpu -q -rfE --durations=12 --timeout "${GPU_TEST_TIMEOUT:-1200}" "$f" \
        >>"$out/$stage.log" 2>&1 || rc=1
      echo "$f: $(tail -1 "$out/$stage.log")"
    done
    echo "$stage: rc=$rc"
    ;;
  serve) serve serve-bf16 --engine bf16 --concurrency 1,8,32,64 ;;
  serve-steady) serve serve-bf16-steady --engine bf16 --concurrency 8,32,64 --requests 4 --timeline-every 8 ;;
  nogil)  # serve-steady at NOGIL_STREAMS once per BATON_NOGIL_LAUNCH (baton/engine/nogil.py): 1 = on, 0 = torch's calls
    for v in ${NOGIL_POINTS:-1 0}; do
      BATON_NOGIL_LAUNCH=$v serve "serve-bf16-steady-nogil$v" --engine bf16 --concurrency "${NOGIL_STREAMS:-32,64}" \
        --requests 4 --check-prompts 1
    done
    ;;
  fp8)
    serve serve-fp8-32 --engine fp8 --concurrency 32
    serve serve-bf16-topp --engine bf16 --concurrency 1,32 --temperature 0.8 --top-p 0.9
    ;;
  sampling)
    python benchmarks/bench_sampling.py --out "$out/sampling.json" >"$out/sampling.log" 2>&1
    echo "sampling: rc=$?"
    # SAMPLING_REQUESTS a stream (default 3): one burst of 32 varied ~10% run to run (0.95x at b503664)
    serve serve-bf16-greedy-1-32 --engine bf16 --concurrency 1,32 --requests "${SAMPLING_REQUESTS:-3}"
    serve serve-bf16-topp --engine bf16 --concurrency 1,32 --temperature 0.8 --top-p 0.9 \
      --requests "${SAMPLING_REQUESTS:-3}"
    ratio "top-p / greedy at 1" "$out/serve-bf16-topp.json" 1 "$out/serve-bf16-greedy-1-32.json" 1 0.95 |
      tee "$out/sampling-ratios.txt"
    ratio "top-p / greedy at 32" "$out/serve-bf16-topp.json" 32 "$out/serve-bf16-greedy-1-32.json" 32 0.95 |
      tee -a "$out/sampling-ratios.txt"
    ;;
  gil)
    points=${SWITCH_POINTS:-5000,500,100}
    for us in ${points//,/ }; do
      BATON_SWITCH_INTERVAL_US=$us serve "serve-steady-switch-$us" --engine bf16 --concurrency 32,64 --requests 4
    done
    ;;
  paced)  # serve-steady at 32, 64 per decode worker's message budget (BATON_STREAM_MESSAGES_PER_S)
    points=${PACE_POINTS:-2000,0}
    for rate in ${points//,/ }; do
      BATON_STREAM_MESSAGES_PER_S=$rate serve "serve-steady-paced-$rate" --engine bf16 --concurrency 32,64 \
        --requests 4 --check-prompts 1 --timeline-every 8
    done
    ;;
  long) serve serve-bf16-16k --engine bf16 --concurrency 32 --max-len 17000 --input-len 16384 --output-len 256 ;;
  verify)
    python benchmarks/bench_verify_under_prefill.py --device cuda --random-init qwen3.5-9b --long 32000 \
      --out "$out/verify-under-prefill.json" >"$out/verify-under-prefill.log" 2>&1
    echo "verify: rc=$?"
    ;;
  burst)
    python benchmarks/bench_ttft_burst.py --random-init qwen3.5-9b --device cuda --prompt 512 --bursts "${BURSTS:-1,8,32}" \
      --profile "$out/ttft-burst-profile.txt" --out "$out/ttft-burst.json" >"$out/ttft-burst.log" 2>&1
    echo "burst: rc=$?"
    ;;
  layout-fixed)
    serve serve-layouts-fixed --engine bf16 --layout both --workload fixed --input-len 512 --output-len 256 \
      --concurrency 1,8,32,64
    ;;
  layout-mixed)
    serve serve-layouts-mixed --engine bf16 --layout both --workload mixed --input-len 512 --output-len 256 \
      --long-frac 0.1 --long-input 4096:16384 --concurrency "" --rate 2,8 --num-prompts 64
    ;;
  spec-fast)
    spec spec-fast-mtp --engine mtp --concurrency 1,8,32 --draft-p 0.9 --draft-k 4
    spec spec-fast-bf16 --engine bf16 --concurrency 32 --check-prompts 1
    ratio "fast mtp p=0.9 at 32 / fast bf16 at 32" "$out/spec-fast-mtp.json" 32 "$out/spec-fast-bf16.json" 32 1.3 |
      tee "$out/spec-fast-ratios.txt"
    ;;
  spec-adaptive)
    spec spec-adaptive-mtp --engine mtp --concurrency "${SPEC_POINTS:-1,8,32}" --draft-p 0.9 --draft-k 4 \
      --mtp-draft-length adaptive
    if [ "${BF16_POINTS:-}" != none ]; then  # BF16_POINTS=none: mtp alone (the bf16 figures of an earlier call)
      spec spec-adaptive-bf16 --engine bf16 --concurrency "${BF16_POINTS:-1,8,32}" --check-prompts 1
    fi
    spec_parts "$out/spec-adaptive-mtp.json" "$out/spec-adaptive-bf16.json"
    # the decode worker's dear speculative rounds (>= 50 ms, one line a second at most: decode_worker/mtp_launch.py)
    grep -h "speculative round of" "$out/spec-adaptive-mtp.serve.log" | sed 's/^.*mtp: //' | head -20
    points=${SPEC_POINTS:-1,8,32}
    for n in ${points//,/ }; do
      ratio "fast mtp adaptive p=0.9 at $n / fast bf16 at $n" "$out/spec-adaptive-mtp.json" $n \
        "$out/spec-adaptive-bf16.json" $n 0.95
    done | tee "$out/spec-adaptive-ratios.txt"
    ;;
  spec-variants)  # fast bf16 and fast mtp adaptive (p = 0.9, K <= 4) at PAIR_N (default 32) streams, one run per
    # entry of VARIANTS in its order, on one host: ENGINE[:VAR=V,...] (default: bf16, mtp, mtp with
    # BATON_MTP_CHAIN_ONE=1, mtp with BATON_MTP_JOIN_HOLD=2); each mtp run's tok/s over the median of the stage's
    # bf16 runs. Runs of one configuration on one H100 host differed by 30% (stop 59): give the reverse order in a
    # second call of the same host and compare medians. 2 requests a stream (SPEC_REQUESTS; spec's default 3): four
    # runs of ~145 s at 3 did not fit one call
    n=${PAIR_N:-32} i=0
    export SPEC_REQUESTS=${SPEC_REQUESTS:-2}
    for v in ${VARIANTS:-bf16 mtp mtp:BATON_MTP_CHAIN_ONE=1 mtp:BATON_MTP_JOIN_HOLD=2}; do
      i=$((i + 1)) e=${v%%:*}
      settings=${v#"$e"} && settings=${settings#:}
      echo "spec-var-$i-$e ${settings:-default}" >>"$out/variants.txt"
      (
        IFS=, read -r -a kvs <<<"$settings"
        for kv in "${kvs[@]}"; do export "${kv?}"; done
        if [ "$e" = bf16 ]; then
          spec "spec-var-$i-$e" --engine bf16 --concurrency "$n" --check-prompts 1
        else
          spec "spec-var-$i-$e" --engine mtp --concurrency "$n" --draft-p 0.9 --draft-k 4 --mtp-draft-length adaptive
        fi
      )
      spec_parts "$out/spec-var-$i-$e.json"
    done
    python - "$out" "$n" <<'EOF'
import json, statistics, sys

out, n = sys.argv[1], int(sys.argv[2])
runs = []
for line in open(f"{out}/variants.txt"):
    name, label = line.split(maxsplit=1)
    try:
        p = next(p for p in json.load(open(f"{out}/{name}.json"))["points"] if p.get("concurrency") == n)
    except (OSError, ValueError, KeyError, StopIteration):
        p = {}
    runs.append((name, label.strip(), p.get("tok_s"), p.get("errors")))
bf16 = [t for name, _, t, err in runs if name.endswith("-bf16") and t and not err]
base = statistics.median(bf16) if bf16 else None
for name, label, t, err in runs:
    r = round(t / base, 3) if t and base and not err else None
    print(f"spec-variants: {name} ({label}): {t} tok/s, {r}x the bf16 median {base}" + (f" FAILED {err}" if err else ""))
EOF
    ;;
  structured-mtp)  # fast mtp under a grammar against bf16 on CUDA (benchmarks/bench_structured_mtp.py, the embedded
    # model in bf16): tokens a round and decode tok/s per grammar, mtp's tokens checked equal to bf16's (on the CPU
    # mtp ran 0.82-0.87x bf16 under a grammar, 0.94-0.95x after stop 63's sampler fix: is a masked mtp session faster than bf16 on the GPU?)
    # (--mixed-runs 1: each mixed mode starts fresh workers, whose CUDA graphs take their time to capture;
    # then exact mode's masked drafts against unconstrained ones: tokens a round, tok/s)
    python benchmarks/bench_structured_mtp.py --device cuda --mixed-runs 1 --out "$out/structured-mtp.json" \
      >"$out/structured-mtp.log" 2>&1
    echo "bench_structured_mtp: rc=$?"
    grep -E '^\{"(grammar|run)' "$out/structured-mtp.log"
    ;;
  spec-exact)
    # where the host time of the rounds goes: each process's stack samples (baton/stack_sampler.py)
    BATON_STACK_SAMPLES="$out/stacks-{role}-{pid}.txt" spec spec-exact-mtp --mode exact --engine mtp \
      --concurrency 1,8,32 --draft-p 0.95 --draft-k 8
    spec spec-exact-bf16 --engine bf16 --concurrency 32 --check-prompts 1
    # the same exact runs with the Draft / Verify gathers pipelined (no PERIODIC merging: on the CPU, 150 -> 207
    # tok/s at 8 sessions; on one GPU the two workers' passes share it, so merging may pay there)
    BATON_GATHER_PERIODIC=0 spec spec-exact-mtp-pipelined --mode exact --engine mtp --concurrency 8,32 \
      --draft-p 0.95 --draft-k 8
    {
      ratio "exact mtp p=0.95 at 8 / at 1" "$out/spec-exact-mtp.json" 8 "$out/spec-exact-mtp.json" 1 5
      ratio "exact mtp p=0.95 at 32 / fast bf16 at 32" "$out/spec-exact-mtp.json" 32 "$out/spec-exact-bf16.json" 32 0.8
      ratio "pipelined exact at 8 / at 1" "$out/spec-exact-mtp-pipelined.json" 8 "$out/spec-exact-mtp.json" 1 5
      ratio "pipelined exact at 32 / fast bf16 at 32" "$out/spec-exact-mtp-pipelined.json" 32 "$out/spec-exact-bf16.json" 32 0.8
    } | tee "$out/spec-exact-ratios.txt"
    ;;
  spec-merged)  # one call for both speculation targets: exact mode at 1, 8, 32 (the workers told they share the GPU:
    # merged gathers; the verdict hidden rows relayed, so the decode worker runs no verdict rows), fast bf16 at
    # 32, exact at 8 and 32 with the decode worker running the verdict rows itself (BATON_VERDICT_HIDDEN=0:
    # the A/B of the relayed rows; VERDICT_AB=0 skips it), fast mtp adaptive at 32 (MERGED_ADAPTIVE=1)
    BATON_LOG_LEVEL=INFO spec spec-exact-mtp --mode exact --engine mtp --concurrency 1,8,32 --draft-p 0.95 --draft-k 8
    grep -ho "[a-z]*: exact rounds [a-z]*" "$out/spec-exact-mtp.log" | sort | uniq -c  # merged, both (efde45a)
    spec spec-bf16 --engine bf16 --concurrency 32 --check-prompts 1
    if [ "${VERDICT_AB:-1}" = 1 ]; then
      BATON_VERDICT_HIDDEN=0 spec spec-exact-mtp-rows --mode exact --engine mtp --concurrency 8,32 --draft-p 0.95 \
        --draft-k 8
    fi
    if [ "${MERGED_ADAPTIVE:-0}" = 1 ]; then
      spec spec-adaptive-mtp --engine mtp --concurrency 32 --draft-p 0.9 --draft-k 4 --mtp-draft-length adaptive
    fi
    {
      ratio "exact mtp p=0.95 at 8 / at 1" "$out/spec-exact-mtp.json" 8 "$out/spec-exact-mtp.json" 1 5
      ratio "exact mtp p=0.95 at 32 / fast bf16 at 32" "$out/spec-exact-mtp.json" 32 "$out/spec-bf16.json" 32 0.8
      ratio "exact at 8, hidden rows relayed / decode worker's rows" "$out/spec-exact-mtp.json" 8 "$out/spec-exact-mtp-rows.json" 8 1
      ratio "exact at 32, hidden rows relayed / decode worker's rows" "$out/spec-exact-mtp.json" 32 "$out/spec-exact-mtp-rows.json" 32 1
      ratio "fast mtp adaptive p=0.9 at 32 / fast bf16 at 32" "$out/spec-adaptive-mtp.json" 32 "$out/spec-bf16.json" 32 0.95
    } | tee "$out/spec-merged-ratios.txt"
    rounds "$out/spec-exact-mtp.json" | tee -a "$out/spec-merged-ratios.txt"
    ;;
  batched)  # exact mtp at 32 with the router's round batcher (DraftMany / VerifyMany, router/batcher.py), short:
    # one warm-up at 8, 2 requests a stream, so that it fits a call of ~250 s; compare round_ms / gathered_wait
    # with spec-merged's at 7996845 (benchmarks/results/gpu-h100-2026-12-06-slim-xm.md)
    spec spec-exact-mtp-batched --mode exact --engine mtp --concurrency 32 --draft-p 0.95 --draft-k 8 --warmup 8 \
      --requests 2
    ;;
  batched-ab)  # the round batcher's same-machine A/B: exact mtp at 8 and 32 batched (the default), then with one
    # unary call a session (BATON_BATCHED_ROUNDS=0), then fast bf16 at 32 for the 0.8x ratio (~450 s); with
    # BATCHED_PIPELINED=1 also the batched run with pipelined gathers (BATON_GATHER_PERIODIC=0), which the
    # batcher's may-come rule no longer slows (router/batcher.py)
    # the batched run with each process's stack samples (baton/stack_sampler.py): where the batch runs' host time goes
    BATON_STACK_SAMPLES="$out/stacks-{role}-{pid}.txt" spec spec-exact-mtp --mode exact --engine mtp \
      --concurrency 8,32 --draft-p 0.95 --draft-k 8
    BATON_BATCHED_ROUNDS=0 spec spec-exact-mtp-unary --mode exact --engine mtp --concurrency 8,32 --draft-p 0.95 \
      --draft-k 8
    spec spec-bf16 --engine bf16 --concurrency 32 --check-prompts 1
    if [ "${BATCHED_PIPELINED:-0}" = 1 ]; then
      BATON_GATHER_PERIODIC=0 spec spec-exact-mtp-pipelined --mode exact --engine mtp --concurrency 8,32 \
        --draft-p 0.95 --draft-k 8
    fi
    {
      ratio "exact at 8, batched / unary rounds" "$out/spec-exact-mtp.json" 8 "$out/spec-exact-mtp-unary.json" 8 1
      ratio "exact at 32, batched / unary rounds" "$out/spec-exact-mtp.json" 32 "$out/spec-exact-mtp-unary.json" 32 1
      ratio "exact mtp p=0.95 at 32 / fast bf16 at 32" "$out/spec-exact-mtp.json" 32 "$out/spec-bf16.json" 32 0.8
      ratio "pipelined exact at 32 / fast bf16 at 32" "$out/spec-exact-mtp-pipelined.json" 32 "$out/spec-bf16.json" 32 0.8
    } | tee "$out/batched-ab-ratios.txt"
    ;;
  exact-fp8)  # exact mode with fp8 drafts (the pipelined AR drafts, decode_worker/drafting.py _ar_pipelined) at 1
    # and 8 streams, every stream checked against `baton complete`; the decode worker offers bf16 and fp8
    serve spec-exact-fp8 --prompts 2 --warmup 1,8 --requests "${SPEC_REQUESTS:-3}" --serve-args "--engines bf16,fp8" \
      --mode exact --engine fp8 --concurrency 1,8 --draft-p 0.95 --draft-k 8
    ;;
  ops)  # where a served exact round's batch time goes: torch.profiler over each worker's Draft / Verify batches
    # (baton/op_profile.py), exact mtp at 8 (60 batches after 60 of >= 4 sessions: past the warm-up at 8), then
    # at 32 (50 batches after 30 of >= 16); each worker writes its op tables and the window's device time
    BATON_OP_PROFILE="$out/ops8-{role}-{pid}.txt" BATON_OP_PROFILE_WINDOW=60:60:4 spec spec-exact-mtp-ops8 \
      --mode exact --engine mtp --concurrency 8 --draft-p 0.95 --draft-k 8
    BATON_OP_PROFILE="$out/ops32-{role}-{pid}.txt" BATON_OP_PROFILE_WINDOW=30:50:16 spec spec-exact-mtp-ops32 \
      --mode exact --engine mtp --concurrency 32 --draft-p 0.95 --draft-k 8
    head -3 "$out"/ops*.txt
    ;;
  slim-ab)  # the draft-only hand-offs' A/B under load (BATON_SLIM_HANDOFF, dbbf6d7): exact mtp at 8 and 32 with slim
    # hand-offs (the default) and with whole ones, and fast bf16 at 32 for the 0.8x ratio, in one call
    spec spec-exact-mtp --mode exact --engine mtp --concurrency 8,32 --draft-p 0.95 --draft-k 8
    BATON_SLIM_HANDOFF=0 spec spec-exact-mtp-whole --mode exact --engine mtp --concurrency 8,32 --draft-p 0.95 \
      --draft-k 8
    spec spec-bf16 --engine bf16 --concurrency 32 --check-prompts 1
    {
      ratio "exact at 8, draft-only / whole hand-offs" "$out/spec-exact-mtp.json" 8 "$out/spec-exact-mtp-whole.json" 8 1
      ratio "exact at 32, draft-only / whole hand-offs" "$out/spec-exact-mtp.json" 32 "$out/spec-exact-mtp-whole.json" 32 1
      ratio "exact mtp p=0.95 at 32 / fast bf16 at 32" "$out/spec-exact-mtp.json" 32 "$out/spec-bf16.json" 32 0.8
    } | tee "$out/slim-ab-ratios.txt"
    ;;
  spec-rows)  # spec-merged's A/B half alone: exact at 8 and 32 with the decode worker running the verdict rows
    BATON_VERDICT_HIDDEN=0 spec spec-exact-mtp-rows --mode exact --engine mtp --concurrency 8,32 --draft-p 0.95 --draft-k 8
    ;;
  prefetch-ab)  # exact mode's next Draft sent before the round's tokens are yielded (router/exact.py, 2833ba5):
    # exact mtp at 1, 8, 32 with it (the default), then at 8 and 32 without (BATON_DRAFT_PREFETCH=0), the ratios
    # and each run's round split (the Draft's time overlaps the sending: round_other_ms may go below 0)
    BATON_LOG_LEVEL=INFO spec spec-exact-prefetch --mode exact --engine mtp --concurrency "${PREFETCH_POINTS:-1,8,32}" \
      --draft-p 0.95 --draft-k 8
    BATON_DRAFT_PREFETCH=0 spec spec-exact-no-prefetch --mode exact --engine mtp --concurrency "${NOPREFETCH_POINTS:-8,32}" --draft-p 0.95 \
      --draft-k 8
    {
      ratio "exact mtp p=0.95 at 8 / at 1 (prefetch)" "$out/spec-exact-prefetch.json" 8 "$out/spec-exact-prefetch.json" 1 5
      for n in 8 32; do
        ratio "exact at $n, prefetch / none" "$out/spec-exact-prefetch.json" $n "$out/spec-exact-no-prefetch.json" $n 1
      done
      for f in prefetch no-prefetch; do
        echo "$f:"
        rounds "$out/spec-exact-$f.json"
      done
    } | tee "$out/prefetch-ratios.txt"
    ;;
  prefill-sdpa)  # the prefill's attention off cuDNN SDPA (BATON_PREFILL_CUDNN_SDPA=0, flash): test_gpu_prefill.py with
    # it, then bench_ttft_burst at BURSTS (default 1,8) with cuDNN (the default) and without, then exact mtp at 1
    # and 8 without (SDPA_SERVE=1; set it against spec-merged's figures on the same machine)
    BATON_PREFILL_CUDNN_SDPA=0 python -m pytest -o addopts="" -m gpu -q -rfE --timeout "${GPU_TEST_TIMEOUT:-1200}" \
      tests/engine/test_gpu_prefill.py >"$out/prefill-sdpa-tests.log" 2>&1
    echo "test_gpu_prefill.py without cuDNN SDPA: rc=$? $(tail -1 "$out/prefill-sdpa-tests.log")"
    for v in 1 0; do
      BATON_PREFILL_CUDNN_SDPA=$v python benchmarks/bench_ttft_burst.py --random-init qwen3.5-9b --device cuda --prompt 512 \
        --bursts "${BURSTS:-1,8}" --out "$out/ttft-burst-cudnn$v.json" >"$out/ttft-burst-cudnn$v.log" 2>&1
      echo "burst, cuDNN SDPA $v: rc=$?"
    done
    if [ "${SDPA_SERVE:-0}" = 1 ]; then
      BATON_PREFILL_CUDNN_SDPA=0 spec spec-exact-no-cudnn --mode exact --engine mtp --concurrency 1,8 --draft-p 0.95 \
        --draft-k 8
      rounds "$out/spec-exact-no-cudnn.json"
    fi
    ;;
  slot-copies)  # the captured slot copies (baton/engine/slot_copies.py, e996170): test_gpu_verify.py (their
    # replays counted, the batched verify bitwise alone), then bench_exact_passes at 8 and 32 (rewind_ms against
    # rewind_eager_ms, one process); SLOT_SERVE=1 adds exact mtp at 8 and 32 served with them and without
    # (BATON_SLOT_COPIES=0) and the ratios
    python -m pytest -o addopts="" -m gpu -q -rfE --timeout "${GPU_TEST_TIMEOUT:-1200}" tests/engine/test_gpu_verify.py \
      >"$out/slot-copies-tests.log" 2>&1
    echo "test_gpu_verify.py: rc=$? $(tail -1 "$out/slot-copies-tests.log")"
    python benchmarks/bench_exact_passes.py --random-init qwen3.5-9b --batch "${PASS_POINTS:-8,32}" --k 8 --reps 5 \
      --out "$out/slot-copies-passes.json" >"$out/slot-copies-passes.log" 2>&1
    echo "exact-passes: rc=$?"
    grep -o "'batch': [0-9]*\|'rewind[a-z_]*': [0-9.]*" "$out/slot-copies-passes.log" | paste -sd' '
    if [ "${SLOT_SERVE:-0}" = 1 ]; then
      spec spec-exact-slot-copies --mode exact --engine mtp --concurrency 8,32 --draft-p 0.95 --draft-k 8
      BATON_SLOT_COPIES=0 spec spec-exact-slot-eager --mode exact --engine mtp --concurrency 8,32 --draft-p 0.95 \
        --draft-k 8
      for n in 8 32; do
        ratio "exact at $n, slot copies / eager" "$out/spec-exact-slot-copies.json" $n \
          "$out/spec-exact-slot-eager.json" $n 1 | tee -a "$out/slot-copies-ratios.txt"
      done
      for f in slot-copies slot-eager; do
        echo "$f:"
        rounds "$out/spec-exact-$f.json"
      done | tee -a "$out/slot-copies-ratios.txt"
    fi
    ;;
  exact-passes)  # a round's device parts alone, one process (bench_exact_passes.py), then the pipelined runs
    python benchmarks/bench_exact_passes.py --random-init qwen3.5-9b --batch "${PASS_POINTS:-1,8,16,32}" --k 8 \
      --out "$out/exact-passes.json" >"$out/exact-passes.log" 2>&1
    echo "exact-passes: rc=$?"
    BATON_GATHER_PERIODIC=0 spec spec-exact-mtp-pipelined --mode exact --engine mtp --concurrency 8,32 \
      --draft-p 0.95 --draft-k 8
    ;;
  tests-xm)  # gemv_config.TUNED_BATCH_XM (BATON_GEMV_XM=1) end to end: the batch-invariance tests with it, then the
    # verify pass A/B (bench_exact_passes, XM 0 then 1); if both hold, its default can become on
    for f in tests/engine/test_gpu_batch.py tests/engine/test_gpu_verify.py tests/engine/test_gemv.py; do
      BATON_GEMV_XM=1 python -m pytest -o addopts="" -m gpu -q -rfE --timeout "${GPU_TEST_TIMEOUT:-1200}" "$f" \
        >>"$out/tests-xm.log" 2>&1
      echo "$f: $(tail -1 "$out/tests-xm.log")"
    done
    for x in 0 1; do
      BATON_GEMV_XM=$x python benchmarks/bench_exact_passes.py --random-init qwen3.5-9b --batch 1,8,32 --k 8 --reps 5 \
        --out "$out/exact-passes-xm$x.json" >"$out/exact-passes-xm$x.log" 2>&1
      echo "exact-passes xm=$x: rc=$?"
    done
    ;;
  sweep-rows)  # the rows GEMM at M > 16 (batched steps and verify passes): BLOCK_M / warps per M, bitwise checked
    python benchmarks/sweep_rows_m.py --ms "${SWEEP_MS:-16,32,64,72,128,144,288,320}" --kinds "${SWEEP_KINDS:-bf16,fp8}" \
      --block-ms "${SWEEP_BLOCK_MS:-32,64,128,256}" --block-ns "${SWEEP_BLOCK_NS:-base}" \
      --xm "${SWEEP_XM:-0}" --shapes "${SWEEP_SHAPES:-gdn_qkvzba,gdn_out,attn_qkv,attn_o,mlp_gate_up,mlp_down,lm_head}" \
      --out "$out/sweep-rows.json" >"$out/sweep-rows.log" 2>&1
    echo "sweep-rows: rc=$?"
    tail -3 "$out/sweep-rows.log"
    ;;
  wide-tma)  # the prefill GEMM's loads (baton/kernels/wide.py KERNEL, BATON_WIDE_GEMM): sweep_wide over pointer and
    # TMA loads x tiles (each config's rows bitwise against the default's; WIDE_SWEEP=0 skips), the wide GEMM's
    # GPU tests (WIDE_TESTS: a -k expression; "not nothing" runs the whole file), then profile_prefill with
    # each of WIDE_KINDS (default "ptr auto": a pass's wall and kernel time); WIDE_BURST=1 adds
    # bench_ttft_burst at 8 and 32 with each
    if [ "${WIDE_SWEEP:-1}" = 1 ]; then
      python benchmarks/sweep_wide.py --ms "${SWEEP_MS:-128,512,2048,4096,8192}" --out "$out/sweep-wide.json" \
        >"$out/sweep-wide.log" 2>&1
      echo "sweep-wide: rc=$?"
    fi
    [ -f "$out/sweep-wide.json" ] && python - "$out/sweep-wide.json" <<'EOF' | tee "$out/sweep-wide-summary.txt"
import json, sys

rows = json.load(open(sys.argv[1]))["rows"]
for m in sorted({r["M"] for r in rows}):
    at = sorted((r for r in rows if r["M"] == m and "ms" in r), key=lambda r: r["ms"])
    print(f"M {m}: cuBLAS {at[0]['cublas_ms']} ms; " + ", ".join(
        f"{r['config']} {r['ms']} ({r['of_cublas']}, bitwise {r['bitwise_as_first_config']})" for r in at))
EOF
    python -m pytest -o addopts="" -m gpu -q -rfE -k "${WIDE_TESTS:-wide_gemm}" tests/engine/test_gpu_prefill.py \
      >"$out/wide-tests.log" 2>&1
    echo "test_gpu_prefill.py -k ${WIDE_TESTS:-wide_gemm}: rc=$? $(tail -1 "$out/wide-tests.log")"
    for k in ${WIDE_KINDS:-ptr auto}; do
      BATON_WIDE_GEMM=$k python benchmarks/profile_prefill.py --lengths 512,4096 --batches 1,8,16 --reps 5 \
        --out "$out/profile-prefill-$k.json" >"$out/profile-prefill-$k.log" 2>&1
      echo "profile_prefill $k: rc=$?"
      python - "$out/profile-prefill-$k.json" <<'EOF'
import json, sys

try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(0)
for p in d.get("points", []):
    print(f"  {p['prompt_len']} tokens: wall {p['wall_ms']} ms, kernels {p['kernel_ms']} ms ({p['kernels']})")
for b in d.get("batched", []):
    print(f"  {b['prompts']} x {b['prompt_len']}: pass {b['pass_ms']} ms")
EOF
    done
    if [ "${WIDE_BURST:-0}" = 1 ]; then
      for k in ${WIDE_KINDS:-ptr auto}; do
        BATON_WIDE_GEMM=$k python benchmarks/bench_ttft_burst.py --random-init qwen3.5-9b --device cuda --prompt 512 \
          --bursts 8,32 --no-plain --out "$out/ttft-burst-$k.json" >"$out/ttft-burst-$k.log" 2>&1
        echo "burst $k: rc=$?"
      done
    fi
    ;;
  prefill-sdpa-batch)  # equal-length first pieces in one SDPA call (baton/models/prefill_attention.py,
    # BATON_PREFILL_SDPA_BATCH=1, off until this runs): its GPU test (bitwise each prompt alone, cuDNN and flash),
    # then bench_ttft_burst at 8 and 32 with it and without (cuDNN's host side: ~1.3 ms a call, 64 a pass of 8)
    python -m pytest -o addopts="" -m gpu -q -rfE -k sdpa_call tests/engine/test_gpu_prefill.py \
      >"$out/sdpa-batch-tests.log" 2>&1
    echo "test_gpu_prefill.py -k sdpa_call: rc=$? $(tail -1 "$out/sdpa-batch-tests.log")"
    burst_ab BATON_PREFILL_SDPA_BATCH sdpa-batch
    ;;
  stage-ab)  # the hand-off's staging by address through the GIL-holding launcher (baton/handoff/staging.py
    # addresses, BATON_STAGE_BY_ADDRESS, on by default since 92af9a2): the streamed hand-off's GPU test with it,
    # then bench_ttft_burst at 8 and 32 with it and without (torch's views and copies, each giving the GIL up
    # beside the prefill's thread); at 5672ba5 on an H200 a burst of 32's first token p50 890 -> 715 ms
    # (benchmarks/results/gpu-h200-2026-12-06.md). AB_POINTS="1": the default alone
    export BATON_STAGE_KV_IN_PLACE=${KV_IN_PLACE:-1}  # (ce7c515) KV copied from its pages in place: its first GPU run
    BATON_STAGE_BY_ADDRESS=1 python -m pytest -o addopts="" -m gpu -q -rfE -k streamed_handoff \
      tests/handoff/test_handoff.py >"$out/stage-tests.log" 2>&1
    echo "test_handoff.py -k streamed_handoff (by address): rc=$? $(tail -1 "$out/stage-tests.log")"
    burst_ab BATON_STAGE_BY_ADDRESS by-address
    ;;
  kv-ab)  # the KV staged from its pages in place (baton/engine/pages.py PagedSource, BATON_STAGE_KV_IN_PLACE, off
    # until this runs), staging by address on: the streamed hand-off's GPU test with it, then bench_ttft_burst at
    # BURSTS with it and without (AB_POINTS "1 0")
    export BATON_STAGE_BY_ADDRESS=1
    BATON_STAGE_KV_IN_PLACE=1 python -m pytest -o addopts="" -m gpu -q -rfE -k streamed_handoff \
      tests/handoff/test_handoff.py >"$out/kv-tests.log" 2>&1
    echo "test_handoff.py -k streamed_handoff (KV in place): rc=$? $(tail -1 "$out/kv-tests.log")"
    burst_ab BATON_STAGE_KV_IN_PLACE kv-in-place
    ;;
  mps-serve)  # `baton serve --processes --device cuda --mps` (deploy/mps.py, d184a9e), its first GPU run: the
    # embedded model served with a private MPS daemon, one --ask answered through the router, the daemon's server
    # listed while the workers run, then SIGTERM: serve exits 0 and no control daemon of its own is left
    python -m baton serve --processes --device cuda --mps --http-port 0 --port 50151 --ask "def fibonacci(n):" \
      >"$out/mps-serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 240); do
      grep -q "baton: answer\|Traceback" "$out/mps-serve.log" && break  # or serve exits (below)
      kill -0 $pid 2>/dev/null || break
      sleep 1
    done
    grep "MPS\|baton: answer\|serving on" "$out/mps-serve.log" | cut -c1-300
    pgrep -af "nvidia-cuda-mps" | tee "$out/mps-serve-daemons.txt"
    nvidia-smi >"$out/mps-serve-smi.txt" 2>&1
    grep -i "mps\|python" "$out/mps-serve-smi.txt" | head -8
    kill -TERM $pid 2>/dev/null
    wait $pid
    echo "baton serve --mps: exit $? after SIGTERM; control daemons left: $(pgrep -c -f nvidia-cuda-mps-control)"
    ;;
  router-burst)  # issue 20's burst target through the router: 32 streams of one 512-token request each (one burst of
    # 32 first tokens), bench_serve bf16 (BURST_POINTS, default 32); TTFT p50 target <= 1.0 s
    serve serve-bf16-burst --engine bf16 --concurrency "${BURST_POINTS:-32}" --requests 1 --check-prompts 1
    python - "$out/serve-bf16-burst.json" <<'EOF2'
import json, sys

for p in json.load(open(sys.argv[1]))["points"]:
    print(f"  burst of {p['concurrency']} through the router: TTFT p50 {p['ttft_s_p50']} s, p99 {p['ttft_s_p99']} s")
EOF2
    ;;
  ctx-max)  # one prompt near the model's whole context through the router (LONG_INPUT tokens, default 260,000 of the
    # 9B's 262,144), 128 new tokens, bf16: pages sized for it, the chunked prefill's TTFT with its heartbeats
    # On an H100 (80 GB) both workers' shares held 722 / 361 pages a runner, under the 1,017 of a 260,200-token
    # window (2026-12-07): there the default is 150,000 tokens, and the decode worker serves bf16 alone (one pool)
    gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    n=${LONG_INPUT:-$([ "${gib:-0}" -gt 100000 ] && echo 260000 || echo 150000)}
    serve serve-bf16-ctx-max --engine bf16 --concurrency 1 --requests 1 --warmup 1 --check-prompts 0 --prompts 1 \
      --input-len "$n" --output-len 128 --max-len $((n + 200)) --serve-args "--engines bf16"
    python - "$out/serve-bf16-ctx-max.json" <<'EOF2'
import json, sys

try:
    for p in json.load(open(sys.argv[1]))["points"]:
        print(f"  {p['prompt_tokens']} prompt tokens: TTFT {p['ttft_s_p50']} s, {p['tok_s']} tok/s after it, "
              f"ITL p50 {p['itl_s_p50']} s, errors {p['errors']}")
except (OSError, ValueError, KeyError) as e:
    print(f"  no result: {e!r}")
EOF2
    ;;
  window-ab)  # what a long window costs short requests: the attention launches a program per (row, kv head, piece
    # of the window) and most exit at once; bf16 at WINDOW_POINTS (default 32) streams of 512 + 128 tokens,
    # --max-len 4,296 against WINDOW_LONG (default 131,072)
    # WINDOW_LOOP=N: a third run of the long window with BATON_ATTN_PIECE_PROGRAMS=N (baton/kernels/attention_loop.py;
    # 0 = one program a piece, the kernel before 2026-12-07)
    long=${WINDOW_LONG:-131072}
    for w in 4296 "$long"; do
      serve "serve-bf16-window$w" --engine bf16 --concurrency "${WINDOW_POINTS:-32}" --requests 2 --check-prompts 2 \
        --output-len 128 --max-len "$w" --serve-args "--engines bf16"
    done
    if [ -n "${WINDOW_LOOP:-}" ]; then
      BATON_ATTN_PIECE_PROGRAMS=$WINDOW_LOOP serve "serve-bf16-window$long-loop" --engine bf16 \
        --concurrency "${WINDOW_POINTS:-32}" --requests 2 --check-prompts 2 --output-len 128 --max-len "$long" \
        --serve-args "--engines bf16"
      ratio "window $long looped / 4296" "$out/serve-bf16-window$long-loop.json" "${WINDOW_POINTS:-32}" \
        "$out/serve-bf16-window4296.json" "${WINDOW_POINTS:-32}" 0.95
    fi
    ratio "window $long / 4296 at ${WINDOW_POINTS:-32}" "$out/serve-bf16-window$long.json" \
      "${WINDOW_POINTS:-32}" "$out/serve-bf16-window4296.json" "${WINDOW_POINTS:-32}" 0.95
    ;;
  partials-ab)  # program partials (BATON_ATTN_PROGRAM_PARTIALS, baton/kernels/attention_loop.py, off): its GPU tests,
    # then one long prompt (LONG_INPUT, default 100,000 tokens) decoded by bf16 alone without and with N = 32: the
    # ITL of one row over a long window (128 programs looping ~12 pieces each, against 391 of one), and the KV
    # pages the smaller scratch leaves
    timeout 200 python -m pytest -q -o addopts="" -m gpu tests/engine/test_gpu_attention_loop.py \
      >"$out/partials-test.log" 2>&1
    echo "test_gpu_attention_loop: rc=$?"
    tail -n 2 "$out/partials-test.log"
    n=${LONG_INPUT:-100000}
    for v in 0 32; do
      BATON_ATTN_PROGRAM_PARTIALS=$v serve "serve-bf16-partials$v" --engine bf16 --concurrency 1 --requests 1 \
        --warmup 1 --check-prompts 0 --prompts 1 --input-len "$n" --output-len 128 --max-len $((n + 200)) \
        --serve-args "--engines bf16"
    done
    python - "$out"/serve-bf16-partials0.json "$out"/serve-bf16-partials32.json <<'EOF2'
import json, sys

for f in sys.argv[1:]:
    try:
        d = json.load(open(f))
    except OSError:
        continue
    cap = d["serve"]["capacity"].get("decode-0", {})
    for p in d["points"]:
        print(f"  {f.rsplit('/', 1)[-1]}: TTFT {p['ttft_s_p50']} s, ITL p50 {p['itl_s_p50']} s, "
              f"decode pages {cap.get('kv_pages')}, errors {p['errors']}")
EOF2
    ;;
  attn-loop)  # the looped split attention (baton/kernels/attention_loop.py, the default since 2026-12-07) bitwise
    # one program a piece at the 9B's attention shape (tests/engine/test_gpu_attention_loop.py), then
    # test_gpu_batch.py with a fixed 32 programs
    timeout 300 python -m pytest -q -o addopts="" -m gpu tests/engine/test_gpu_attention_loop.py \
      >"$out/attn-loop-test.log" 2>&1
    echo "test_gpu_attention_loop: rc=$?"
    BATON_ATTN_PIECE_PROGRAMS=32 timeout 600 python -m pytest -q -o addopts="" -m gpu tests/engine/test_gpu_batch.py \
      >"$out/attn-loop-batch.log" 2>&1
    echo "test_gpu_batch with 32 programs: rc=$?"
    tail -n 3 "$out"/attn-loop-*.log
    ;;
  prefix-serve)  # the prefix cache through the router (module doc above): a system prompt of 17K tokens, so both
    # boundaries (8,192 and 16,384) and the token after each lie inside it: both pieces are reused.
    # PREFILL_PIECE=N: the prefill worker cuts prompts into N-token pieces (taken only if its start-up cut check
    # passes: its log says which); at N = 1024 the boundaries every 1,024 tokens of the shared 17,408 restore 16,384
    piece=${PREFILL_PIECE:+ --prefill-piece $PREFILL_PIECE}
    for v in 16 0; do
      serve "serve-bf16-prefix$v" --engine bf16 --concurrency 1,8 --requests 2 --warmup 1 --check-prompts 2 \
        --prompts 8 --input-len 19456 --shared-prefix 17408 --output-len 64 --max-len 19800 \
        --serve-args "--engines bf16 --prefix-cache $v$piece"
      python - "$out/serve-bf16-prefix$v.json" <<'EOF2'
import json, sys

try:
    for p in json.load(open(sys.argv[1]))["points"]:
        print(f"  {p['concurrency']} streams: TTFT p50 {p['ttft_s_p50']} s, cached {p['cached_prompt_tokens']} of "
              f"{p['prompt_tokens']} prompt tokens, hits {p.get('prefix_cache_hits')}, evicted "
              f"{p.get('prefix_cache_evicted')} (for pages {p.get('prefix_cache_reclaimed')})")
except (OSError, ValueError, KeyError) as e:
    print(f"  no result: {e!r}")
EOF2
    done
    ;;
  prefix-cache)  # a long prompt's first token with its first pieces cached, against computed (module doc above)
    python benchmarks/bench_prefix_cache.py --device cuda --random-init qwen3.5-9b \
      --lengths "${PREFIX_LENGTHS:-16384,32768}" --repeat "${PREFIX_REPEAT:-3}" --out "$out/prefix-cache.json" \
      >"$out/prefix-cache.log" 2>&1
    echo "bench_prefix_cache: rc=$?"
    grep "^  {" "$out/prefix-cache.log"
    ;;
  cut-probe)  # whether a prompt cut at page multiples keeps the whole prompt's state at the 9B shape (the
    # question a prefix cache finer than 8,192-token pieces rests on; benchmarks/probe_cut_invariance.py; on
    # the 2-core CPU 256 and 512 are bitwise, 300 is not)
    timeout 300 python benchmarks/probe_cut_invariance.py --device cuda --shape qwen3.5-9b --tokens 2600 \
      --grains "${CUT_GRAINS:-256,1024,2048,300}" --out "$out/cut-probe.json" >"$out/cut-probe.log" 2>&1
    echo "probe_cut_invariance: rc=$?"
    python -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['grains']))" "$out/cut-probe.json"
    ;;
  fla-bits)  # whether fla's autotuned configs change the prefill's bits (benchmarks/fla_config_bits.py): the 9B's GDN
    # delta rule, 300 tokens whole and in 128-token pieces, each used autotuner held to each of its configs
    # --write-pins: each kernel's fastest config as Baton's pins (copy $out/fla-configs/GPU/ to
    # baton/assets/fla-configs/ and commit); then tests/model/test_gpu_fla_pins.py with them in place
    python benchmarks/fla_config_bits.py --random-init qwen3.5-9b --out "$out/fla-config-bits.json" \
      --write-pins "$out/fla-configs" >"$out/fla-config-bits.log" 2>&1
    echo "fla_config_bits: rc=$?"
    if [ "${PIN_TEST:-1}" = 1 ] && [ -d "$out/fla-configs" ]; then
      cp -r "$out/fla-configs/." baton/assets/fla-configs/
      timeout 600 python -m pytest -q -o addopts="" -m gpu tests/model/test_gpu_fla_pins.py >"$out/fla-pins-test.log" 2>&1
      echo "test_gpu_fla_pins: rc=$?"
      tail -3 "$out/fla-pins-test.log"
      for d in "$out"/fla-configs/*/; do  # not committed yet: later stages on this machine run without them
        rm -rf "baton/assets/fla-configs/$(basename "$d")"
      done
    fi
    python - "$out/fla-config-bits.json" <<'EOF2'
import json, sys

d = json.load(open(sys.argv[1]))
print(f"  repeatable {d.get('repeatable')}; kernels that vary: {d.get('kernels_that_vary')}; tuned {d.get('tuned_ms')} ms")
for k in d.get("kernels", []):
    print(f"  {k['kernel']}: {k['valid']} of {k['configs']} configs ran, {k['distinct']} distinct results, tuned {k['tuned']}")
    if k["varies"]:
        print("    ms by config: " + "; ".join(f"{r['config']} {r.get('ms', r.get('error'))}" for r in k["runs"]))
EOF2
    ;;
  accept-default)  # issue 21's "trained default model, MTP tokens per round at K = 3, batched" on the GPU
    # (benchmarks/acceptance_default_model.py: every prompt's tokens equal the exact AR's, alone and batched)
    python benchmarks/acceptance_default_model.py --device cuda --dtype bf16 --no-hf \
      >"$out/acceptance-default-model.json" 2>"$out/acceptance-default-model.log"
    echo "acceptance_default_model: rc=$?"
    python -c "import json,sys; d=json.load(open(sys.argv[1])); m = d['mtp']; print({'identical': d['all_paths_identical_to_exact_ar'], 'mtp_per_round': m['accept_len_per_round'], 'batched': m['batched'], 'fp8_rate': d['exact_fp8']['acceptance_rate']})" \
      "$out/acceptance-default-model.json" 2>&1 | cut -c1-900
    ;;
  hold-ab)  # fast mtp adaptive at HOLD_POINTS (default 32) with the join hold (BATON_MTP_JOIN_HOLD=1,
    # decode_worker/mtp_launch.py: no speculative round while a wave of sessions joins) and without, then bf16
    points=${HOLD_POINTS:-32}
    for h in 1 0; do
      BATON_MTP_JOIN_HOLD=$h spec spec-adaptive-mtp-hold$h --engine mtp --concurrency "$points" --draft-p 0.9 \
        --draft-k 4 --mtp-draft-length adaptive
      grep -h "speculative round of" "$out/spec-adaptive-mtp-hold$h.serve.log" | sed 's/^.*mtp: //' | head -8
    done
    spec spec-adaptive-bf16 --engine bf16 --concurrency "$points" --check-prompts 1
    for n in ${points//,/ }; do
      for h in 1 0; do
        ratio "fast mtp adaptive at $n, join hold $h / fast bf16" "$out/spec-adaptive-mtp-hold$h.json" $n \
          "$out/spec-adaptive-bf16.json" $n 0.95
      done
    done | tee "$out/hold-ab-ratios.txt"
    ;;
  shared-prompt)  # equal prompts in one prefill pass computed once (baton/engine/prefill.py shared_firsts): the
    # GPU test of their bits, then bench_shared_prompt (8 equal 512-token prompts against 8 distinct, and one)
    python -m pytest -o addopts="" -m gpu -q -rfE -k "equal_prompts" tests/engine/test_gpu_prefill.py \
      >"$out/shared-prompt-tests.log" 2>&1
    echo "test_gpu_prefill.py -k equal_prompts: rc=$? $(tail -1 "$out/shared-prompt-tests.log")"
    python benchmarks/bench_shared_prompt.py --device cuda --random-init qwen3.5-9b --prompt 512 --n 8 \
      --out "$out/shared-prompt.json" >"$out/shared-prompt.log" 2>&1
    echo "bench_shared_prompt: rc=$?"
    grep -o '"[a-z_]*_ms": [0-9.]*\|"distinct_over_equal": [0-9.]*' "$out/shared-prompt.log" | paste -sd' '
    ;;
  *)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
