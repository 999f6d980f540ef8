"""`baton generate` and `baton health`: command-line clients of a running router (no torch imported).

    baton generate [--addr A] [--mode fast|exact] [--engine bf16|fp8|mtp] [--max-new-tokens N] [--json]
                   [--temperature T --top-p P --top-k K --seed S --stop STR ...
                   --repetition-penalty R --presence-penalty P --frequency-penalty F --logit-bias ID=V ...]
                   [--exact-policy coupling|rejection] PROMPT
        streams the text to stdout; --json prints one object at the end:
        {"token_ids", "text", "finish_reason", "usage", "stats"}
    baton health [--addr A] [--service NAME] [--timeout S]
        prints the status on stdout (SERVING, NOT_SERVING, SERVICE_UNKNOWN, or the gRPC code of a failed
        check, e.g. UNAVAILABLE) and, when not SERVING, why on stderr (grpc's reason: connection refused...)
Exit codes of `baton generate`: 0 ok, 1 the router answered with an error (`CODE: details` on stderr), 2 usage.
Exit codes of `baton health` (HEALTH_EXIT; distinct, as grpc_health_probe's are): 0 SERVING; 1 the server
answered, not SERVING (NOT_SERVING, SERVICE_UNKNOWN, or NOT_FOUND: no such --service); 2 usage; 3 unreachable
(UNAVAILABLE: refused, no route, name not resolved, TLS handshake; DEADLINE_EXCEEDED: no answer in
--timeout); 4 another RPC error (e.g. UNAUTHENTICATED where health is protected, UNIMPLEMENTED: no health
service there).
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from baton.client import DEFAULT_ADDR, Client
from baton.settings import SettingsError, read_token_file

COMMAND_HELP = {"generate": "stream a completion from a running router", "health": "check a router's gRPC health"}


def add_arguments_for(cmd: str, p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", default=DEFAULT_ADDR, help=f"router address (default {DEFAULT_ADDR})")
    p.add_argument("--token-file", default=None, help="file holding the bearer token (else BATON_TOKEN[_FILE])")
    p.add_argument("--tls-ca", default=None, help="CA bundle to verify the router (enables TLS)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    if cmd == "health":
        p.add_argument("--service", default="", help='health service name (default "": the whole server)')
        return
    p.add_argument(
        "--mode", choices=["fast", "exact"], default="fast", help="exact: every token verified (default fast)"
    )
    p.add_argument(
        "--engine", choices=["bf16", "fp8", "mtp"], default=None, help="decode engine (default: the worker's)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="default %(default)s")
    p.add_argument("--stop-token-ids", default="", help="comma-separated ids that end the completion")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the model's EOS tokens")
    p.add_argument("--draft-block", type=int, default=0, help="exact mode K (0 = the router's default)")
    p.add_argument("--prompt-ids", default=None, help="comma-separated prompt token ids instead of PROMPT")
    add_sampling_arguments(p)
    p.add_argument(
        "--exact-policy",
        choices=("coupling", "rejection"),
        default=None,
        help="exact mode at T > 0: coupling (token-identical to `baton complete`) or rejection (speculative "
        "rejection sampling, exact in distribution); default: the server's",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text")


def add_sampling_arguments(p: argparse.ArgumentParser, stop: bool = True) -> None:
    """The sampling flags of `baton generate` and `baton complete` (SamplingParams)."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling (0 or 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="keep tokens with p >= min_p * p_max (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: drawn, reported in stats.seed)")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=0.0,
        help="prompt and generated tokens: /r or *r, [0, 10] (0 or 1 = off)",
    )
    p.add_argument("--presence-penalty", type=float, default=0.0, help="once per generated token, [-2, 2] (0 = off)")
    p.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="per occurrence in the generated tokens, [-2, 2]"
    )
    p.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        type=_bias,
        metavar="ID=VALUE",
        help="add VALUE in [-100, 100] to token ID's logit (repeatable, at most 300 ids)",
    )
    p.add_argument(
        "--thinking-budget",
        type=int,
        default=None,
        metavar="N",
        help="at most N tokens inside the <think> block the prompt leaves open, then </think> (vLLM's "
        "thinking_token_budget; no effect where none is open or </think> is not one token)",
    )
    p.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="generate at least this many tokens before EOS, a stop id or a stop string may end (0 = off)",
    )
    if stop:
        p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable, at most 16)")
    g = p.add_mutually_exclusive_group()  # structured outputs (SamplingParams.structured)
    g.add_argument(
        "--json-schema", metavar="SCHEMA", help="the output is JSON valid against SCHEMA (JSON text, or @FILE)"
    )
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", help="the output matches this regular expression")
    g.add_argument("--grammar", metavar="EBNF", help="the output follows this EBNF grammar (rule root; or @FILE)")
    g.add_argument("--choice", action="append", help="the output is one of these strings (repeatable)")


def _bias(text: str) -> tuple[int, float]:
    tid, sep, val = text.partition("=")
    try:
        return int(tid), float(val)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected TOKEN_ID=VALUE, e.g. 42=-100") from None


def sampling_kwargs(args) -> dict:
    names = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty")
    names += ("frequency_penalty", "min_tokens", "thinking_budget")
    return {n: getattr(args, n) for n in names} | {"logit_bias": dict(args.logit_bias), "structured": structured(args)}


def structured(args) -> dict | None:
    """The structured-output flags -> Client.generate's `structured` (None: none given); @FILE reads a file."""

    def text(v: str) -> str:
        if not v.startswith("@"):
            return v
        try:
            return open(v[1:], encoding="utf-8").read()
        except OSError as e:
            raise SystemExit(f"baton: {v}: {e.strerror}") from None

    if getattr(args, "json_schema", None):
        return {"json_schema": text(args.json_schema)}
    if getattr(args, "json_object", False):
        return {"json_object": True}
    if getattr(args, "regex", None):
        return {"regex": args.regex}
    if getattr(args, "grammar", None):
        return {"grammar": text(args.grammar)}
    if getattr(args, "choice", None):
        return {"choice": list(args.choice)}
    return None


def _ids(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"baton: {flag} must be comma-separated integers") from None


def _client(args) -> Client:
    token = read_token_file(args.token_file) if args.token_file else None
    return Client(args.addr, token=token, tls_ca=args.tls_ca)


def run_for(cmd: str, args) -> int:
    try:
        with _client(args) as c:
            return _health(c, args) if cmd == "health" else _generate(c, args)
    except SettingsError as e:
        print(f"baton {cmd}: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(f"baton {cmd}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1


HEALTH_EXIT = {"serving": 0, "not_serving": 1, "usage": 2, "unreachable": 3, "rpc_error": 4}
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _health(c: Client, args) -> int:
    timeout = args.timeout or 5.0
    try:
        status = c.check_health(args.service, timeout=timeout)
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            details = f"no answer in {timeout:g} s ({details})"
        if code == grpc.StatusCode.NOT_FOUND:  # grpc.health.v1: the server does not know --service
            print("SERVICE_UNKNOWN")
            print(f"baton health: {args.addr}: no health service {args.service!r} ({details})", file=sys.stderr)
            return HEALTH_EXIT["not_serving"]
        print(code.name)
        what = "unreachable" if code in _UNREACHABLE else "health check failed"
        print(f"baton health: {args.addr} {what}: {code.name}: {details}", file=sys.stderr)
        return HEALTH_EXIT["unreachable" if code in _UNREACHABLE else "rpc_error"]
    print(status)
    if status != "SERVING":
        name = f"service {args.service!r}" if args.service else "the server"
        print(f"baton health: {args.addr} answered: {name} is {status}", file=sys.stderr)
    return HEALTH_EXIT["serving" if status == "SERVING" else "not_serving"]


def _generate(c: Client, args) -> int:
    if (args.prompt is None) == (args.prompt_ids is None):
        print("baton generate: give a PROMPT or --prompt-ids (not both)", file=sys.stderr)
        return 2
    prompt = _ids(args.prompt_ids, "--prompt-ids") if args.prompt_ids is not None else args.prompt
    ids, text, last = [], [], None
    for d in c.generate(
        prompt,
        max_new_tokens=args.max_new_tokens,
        mode=args.mode,
        engine=args.engine,
        stop_token_ids=_ids(args.stop_token_ids, "--stop-token-ids"),
        ignore_eos=args.ignore_eos,
        draft_block=args.draft_block,
        timeout=args.timeout,
        stop=args.stop,
        exact_policy=args.exact_policy,
        **sampling_kwargs(args),
    ):
        ids += d.token_ids
        text.append(d.text)
        last = d
        if not args.json:
            sys.stdout.write(d.text)
            sys.stdout.flush()
    if args.json:
        print(
            json.dumps(
                {
                    "token_ids": ids,
                    "text": "".join(text),
                    "finish_reason": last and last.finish_reason,
                    "usage": last.usage if last else {},
                    "stats": last.stats if last else {},
                }
            )
        )
    else:
        sys.stdout.write("\n")
    return 0
