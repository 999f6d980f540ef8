"""`baton complete`: greedy decoding (or seeded sampling) in-process with the exact engine, one token at a time.

This is the reference every serving path is checked against: it runs ExactEngine.generate, i.e.
prefill then fixed-width AR rows, exactly what the prefill worker's Verify compares drafts with.
Greedy by default; --temperature / --top-p / --top-k / --min-p / --seed sample and --repetition-penalty /
--presence-penalty / --frequency-penalty penalize exactly as the workers do (baton/engine/sampling.py,
penalties.py: the same seed and penalties give the same tokens as a served request with them);
--stop ends the text before a stop string, as the router does (router/stops.py); --min-tokens N holds EOS
back for the first N tokens (and stop strings, as the router: sampling_rules.ban_until).
"""

from __future__ import annotations

import argparse
import json
import sys

from baton.engine.runner import DEFAULT_MAX_LEN, DEFAULT_WIDTH, ModelRunner
from baton.loading import load_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded model)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompt-ids", help="comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=32, help="default %(default)s")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    p.add_argument("--dtype", default=None, help="bf16 or fp32 (default: bf16 on cuda, fp32 on cpu, as the workers)")
    p.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="fixed row width W of the exact engine")
    p.add_argument(
        "--max-len",
        type=int,
        default=DEFAULT_MAX_LEN,
        help="window; must equal the workers' --max-len for bitwise-identical output",
    )
    p.add_argument("--ignore-eos", action="store_true", help="go on past the model's EOS tokens")
    p.add_argument("--json", action="store_true", help='print {"prompt_ids", "token_ids", "text", "seed"}')
    from baton.client_cli import add_sampling_arguments

    add_sampling_arguments(p)


def complete(
    model_dir,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    device="cpu",
    dtype=None,
    width=DEFAULT_WIDTH,
    max_len=0,
    ignore_eos=False,
    loaded=None,
    sampling=None,
) -> list[int]:
    """sampling: baton.engine.sampling.Params (None = greedy)."""
    from baton import grammar
    from prefill_worker.engine import ExactEngine

    dtype = dtype or ("bf16" if str(device).startswith("cuda") else "fp32")
    lm = loaded or load_model(model_dir, dtype=dtype, device=device, mtp=False)
    runner = ModelRunner(lm.model, slots=1, max_len=max_len or DEFAULT_MAX_LEN, width=width)
    eos = () if ignore_eos else lm.cfg.eos_token_ids
    engine = ExactEngine(runner)
    engine.grammars = grammar.source(
        model_dir if loaded is None else lm.model_dir, lm.cfg.vocab_size, lm.cfg.eos_token_ids
    )
    return engine.generate(prompt_ids, max_new_tokens, eos_ids=eos, sampling=sampling)


def run(args) -> int:
    from baton.loading import resolve_model_dir
    from baton.tokenizer import Tokenizer

    try:  # a missing directory or tokenizer.json: one line, not a traceback
        model_dir = resolve_model_dir(args.model)
        tok = Tokenizer.from_dir(model_dir)
    except (OSError, ValueError) as e:
        print(f"baton complete: {e}", file=sys.stderr)
        return 2
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            print("baton complete: --prompt-ids must be comma-separated integers", file=sys.stderr)
            return 2
    else:
        ids = tok.encode(args.prompt)
    if args.max_new_tokens < 1:
        print("baton complete: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    if not 0 <= args.min_tokens <= args.max_new_tokens:
        print("baton complete: --min-tokens must be in 0..--max-new-tokens", file=sys.stderr)
        return 2
    eos = () if args.ignore_eos else _eos_ids(model_dir)
    sampling, seed = _sampling(args, tok.vocab_size, ids, eos, tok)
    if isinstance(sampling, str):
        print(f"baton complete: {sampling}", file=sys.stderr)
        return 2
    try:
        out = complete(
            model_dir,
            ids,
            args.max_new_tokens,
            device=args.device,
            dtype=args.dtype,
            width=args.width,
            max_len=args.max_len,
            ignore_eos=args.ignore_eos,
            sampling=sampling,
        )
    except (OSError, ValueError) as e:  # the checkpoint (missing weights, a config it cannot serve), --device
        print(f"baton complete: {e}", file=sys.stderr)
        return 2
    from router.stops import TextStream

    stream = TextStream(tok.stream(skip_special_tokens=True), tuple(args.stop), min_tokens=args.min_tokens)
    text, kept = stream.feed(out)
    if not stream.stopped:
        text += stream.finish()[0]
    out = out[:kept]
    if args.json:
        print(json.dumps({"prompt_ids": ids, "token_ids": out, "text": text, "seed": seed}))
    else:
        print((args.prompt or "") + text)
    return 0


def _eos_ids(model_dir) -> tuple[int, ...]:
    from baton.config import ModelConfig

    return tuple(ModelConfig.from_hf(model_dir).eos_token_ids)


def _sampling(args, vocab: int | None = None, ids=(), eos=(), tok=None):
    """-> (Params, seed) from the flags (the same checks as the router; logit_bias ids below `vocab`;
    --min-tokens holds `eos` back below len(ids) + min_tokens; --thinking-budget resolved on the prompt `ids`
    with `tok`, as the router does), or (error message, None)."""
    import secrets

    from baton import client_cli, sampling_rules
    from baton.client import structured_output
    from baton.engine.sampling import Params
    from baton.v1 import common_pb2

    msg = common_pb2.SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, stop=args.stop
    )
    msg.repetition_penalty, msg.presence_penalty = args.repetition_penalty, args.presence_penalty
    msg.frequency_penalty, msg.min_tokens = args.frequency_penalty, args.min_tokens
    for tid, val in args.logit_bias:
        msg.logit_bias[tid] = val
    spec = client_cli.structured(args)
    if spec is not None:
        msg.structured.CopyFrom(structured_output(spec))
    if args.seed is not None:
        msg.seed = args.seed % (1 << 64)
    if getattr(args, "thinking_budget", None) is not None:
        msg.thinking_budget = args.thinking_budget
    try:
        resolved, _ = sampling_rules.plan(msg, True, secrets.randbits(64), vocab)
        sampling_rules.ban_until(resolved, len(ids), eos)
        sampling_rules.think_budget(resolved, ids, tok)
    except ValueError as e:
        return str(e), None
    return Params.from_proto(resolved), resolved.seed
