"""The state hand-off: one request's HybridState tensors -> a StateChunk stream -> the decode worker.

Lifecycle of one hand-off, in file order:
    prefill worker   engine.export(session) -> [StateTensor] (views of the slot, no copy);
                     progress.PrefillProgress says which layers are final while the prefill still runs
      push           start_push: header + data frames (encode, frames), hashed in the wire pool, sent to
                     decode_target's LoadState over a pooled channel; or, with the sender process
                     (sender/), staged into shared memory (staging) and sent by a child process
      policy         which tensors are shipped (the MTP KV rule)
    decode worker
      receive        receive_state: header checked against the receiving layout, every chunk verified
                     (decode.StateReceiver), then the manifest; a ReceivedState or a wire.StateError
      slot_fill      SlotFill places it into a reserved slot, activated only at commit()
    timeline         per-step marks of both sides, returned in BridgeReport.timeline when asked for

The format itself (stream layout, chunk plan, digests and errors) is documented in wire.py.
"""
