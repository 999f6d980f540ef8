"""What the prefill and decode workers share.

Lifecycle of a worker process (python -m prefill_worker | python -m decode_worker):
    process.StopSignals(role)             first: a SIGINT/SIGTERM while starting exits 0 (LoadInterrupted)
    command_line.options_from_args -> options.WorkerOptions
    options.settings_for(token_file)      baton.settings + --token-file
    serve_*(...) -> (process.WorkerHandle, servicer)   model -> engine -> gRPC server -> health SERVING
    process.run_until_signal(role, handle, grace, signals)  SIGINT/SIGTERM -> NOT_SERVING -> drain -> close
Inside Ray the same serve_*() runs in an actor (actor.WorkerActor, actor.make_remote). Every RPC of
either servicer runs under servicer.ServicerBase.call(context).
"""
