"""Typed getters of an OpenAI request body's fields (router/http/schemas.py): each returns the value, the
default when the field is absent or null, or raises ApiError(400) naming the field and saying why.

    _int(body, "n", 1, 64) / _bool(body, "stream", False) / _num(body, "temperature")
    _only(body, "suffix", ok, why)   a field Baton does not support (yet) in this value
    _stops(v), _ids(v, "prompt")     stop strings (at most MAX_STOPS, MAX_STOP_BYTES each), token-id lists
    _str(item, "call_id", where)     a required string of an object inside the body (named where.key)
    _text(v, where, kinds)           a string, or a list of text parts / blocks of those types, joined
                                     (the Responses and Messages APIs' content)
"""

from __future__ import annotations

import math

from router.http.errors import bad

MAX_STOPS = 16
MAX_STOP_BYTES = 256
U32 = 1 << 32


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _int(body: dict, name: str, lo: int, hi: int = U32 - 1, where: str = "") -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(where + name, f"expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise bad(where + name, f"{v} is out of range {lo}..{hi}")
    return v


def _bool(body: dict, name: str, default: bool, where: str = "") -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(where + name, f"expected true or false, got {type(v).__name__}")
    return v


def _num(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_num(v):
        raise bad(name, f"expected a finite number, got {v!r:.40}")
    return float(v)


def _only(body: dict, name: str, ok, why: str) -> None:
    """Refuse a field whose value is not one Baton supports yet (absent / null always passes)."""
    v = body.get(name)
    if v is not None and not ok(v):
        raise bad(name, why + f" (got {v!r:.40})")


def _stops(v) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "expected a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    for s in stops:
        if not s:
            raise bad("stop", "an empty string cannot stop anything")
        if len(s.encode("utf-8")) > MAX_STOP_BYTES:
            raise bad("stop", f"a stop string is {len(s.encode('utf-8'))} bytes of UTF-8: at most {MAX_STOP_BYTES}")
    return tuple(dict.fromkeys(stops))


def _ids(v, name: str, allow_empty: bool = False) -> list[int]:
    if not isinstance(v, list) or not (v or allow_empty):
        raise bad(name, "expected a non-empty list of token ids")
    for i, t in enumerate(v):
        if not _is_int(t) or not 0 <= t < U32:
            raise bad(name, f"token id {t!r:.30} at index {i} is not an integer in 0..{U32 - 1}")
    return list(v)


def _str(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad(f"{where}.{key}", f"expected a string, got {type(v).__name__}")
    return v


def _text(v, where: str, kinds: tuple[str, ...]) -> str:
    """A string, or a list of {"type": one of kinds, "text": str} parts, joined; 400 naming where[j] else."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad(where, f"expected a string or a list of text parts, got {type(v).__name__}")
    texts = []
    for j, p in enumerate(v):
        if not isinstance(p, dict) or p.get("type") not in kinds or not isinstance(p.get("text"), str):
            got = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise bad(f"{where}[{j}]", f"{got!r:.40}: only text parts ({', '.join(kinds)}) are served")
        texts.append(p["text"])
    return "".join(texts)
