"""POST /tokenize and /detokenize (vLLM's shapes): the served model's tokenizer and chat template, no model.

    tokenize(body, lim)     {"prompt": str} or {"messages": [...], "add_generation_prompt", "chat_template_kwargs",
                            "tools", "tool_choice"} -> {"count", "max_model_len", "tokens"}: the ids a completion
                            or a chat request with that body would send (router/http/schemas.py: chat_prompt,
                            a forced call's opening included)
    detokenize(body, lim)   {"tokens": [ids]} -> {"prompt": text} (every id below the vocabulary)
"model" is checked as on the other endpoints. `add_special_tokens` is accepted and has no effect: Baton's
tokenizer adds none (the chat template writes them), as Qwen's adds none. 400 naming the field otherwise.
"""

from __future__ import annotations

from router.http.errors import bad
from router.http.fields import _bool, _ids
from router.http.schemas import Limits, _encode, chat_prompt, check_model


def tokenize(body, lim: Limits) -> dict:
    check_model(body, lim)
    _bool(body, "add_special_tokens", True)
    if "messages" in body:
        if "prompt" in body:
            raise bad("prompt", "give prompt or messages, not both")
        text, _ = chat_prompt(body, lim)
        ids = _encode(text, lim, "messages")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad("prompt", "required: a string (or give messages)")
        ids = _encode(prompt, lim, "prompt")
    return {"count": len(ids), "max_model_len": lim.usable, "tokens": ids}


def detokenize(body, lim: Limits) -> dict:
    check_model(body, lim)
    ids = _ids(body.get("tokens"), "tokens", allow_empty=True)
    if lim.tokenizer is None:
        raise bad("tokens", "this router has no tokenizer")
    vocab = lim.tokenizer.vocab_size
    bad_at = next((i for i, t in enumerate(ids) if t >= vocab), None)
    if bad_at is not None:
        raise bad("tokens", f"token id {ids[bad_at]} at index {bad_at} is not below the vocabulary size {vocab}")
    return {"prompt": lim.tokenizer.decode(ids)}
