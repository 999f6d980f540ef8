"""The decode core both workers build on: a model, its slot-indexed state, and how rows run through it.

    state.HybridState      the static, slot-indexed GDN / attention state (one slot per session)
    slots.SlotTable        sessions -> slots, with a TTL
    runner.ModelRunner     a model + its HybridState; the rows step (eager, or fused on CUDA)
    fast_rows              the fused CUDA rows step (the same arithmetic as the eager rows path)
    graph                  CUDA-graph capture of whole decode steps
    speculation            the accept / rewind rules of a verify block, shared by both workers

The role engines sit on top: decode_worker/engine.py (DecodeEngine) and prefill_worker/engine.py
(ExactEngine). Each owns one ModelRunner and, today, serialises its steps behind one lock; the batch
scheduler of continuous batching goes here, between those engines and the runner (docs/ARCHITECTURE.md).
"""
