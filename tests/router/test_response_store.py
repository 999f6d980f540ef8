"""router/http/response_store.py: the Responses API's stored responses (a chain of turns, bounded by bytes,
least recently used out first with every stored chain whole)."""

from __future__ import annotations

import json

import pytest

from router.http.response_store import ResponseStore, StoreMiss


def _resp(rid: str, pad: int = 0) -> dict:
    return {"id": rid, "object": "response", "pad": "x" * pad}


def _item(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def _size(rid: str, items: list, pad: int = 0) -> int:
    return len(json.dumps(_resp(rid, pad))) + len(json.dumps(items))


def test_a_chain_joins_its_turns_oldest_first():
    st = ResponseStore(10_000)
    st.put(_resp("a"), [_item("1"), _item("A")], None)
    st.put(_resp("b"), [_item("2"), _item("B")], "a")
    st.put(_resp("c"), [_item("3")], "b")
    st.put(_resp("b2"), [_item("2'")], "a")  # a branch from the same turn
    assert [i["content"] for i in st.items("c")] == ["1", "A", "2", "B", "3"]
    assert [i["content"] for i in st.items("b2")] == ["1", "A", "2'"]
    assert st.get("b") == _resp("b") and st.get("zz") is None and len(st) == 4
    assert st.used == sum(
        _size(r, i) for r, i in [("a", [_item("1"), _item("A")]), ("b", [_item("2"), _item("B")])]
    ) + _size("c", [_item("3")]) + _size("b2", [_item("2'")])
    with pytest.raises(StoreMiss) as e:
        st.items("nope")
    assert (e.value.wanted, e.value.missing) == ("nope", "nope")
    assert st.delete("b") and not st.delete("b")
    with pytest.raises(StoreMiss) as e:  # its child's chain lost a turn: named
        st.items("c")
    assert (e.value.wanted, e.value.missing) == ("c", "b")
    assert [i["content"] for i in st.items("b2")] == ["1", "A", "2'"]  # the other branch is whole


def test_eviction_takes_the_least_recent_conversations_latest_turn_and_keeps_chains_whole():
    one = _size("x0", [_item("t")], 100)
    st = ResponseStore(6 * one)
    for conv in "xy":  # two conversations of three turns each: the store is full
        for t in range(3):
            st.put(_resp(f"{conv}{t}", 100), [_item("t")], f"{conv}{t - 1}" if t else None)
    assert len(st) == 6 and st.used == 6 * one
    st.items("x2")  # conversation x used again: y is now the least recent
    st.put(_resp("z0", 100), [_item("t")], None)
    assert st.get("y2") is None and st.evicted == 1  # y's latest turn, not its root
    for rid in ("x2", "y1", "z0"):  # every stored response can still be continued
        st.items(rid)
    assert st.used <= st.max_bytes


def test_a_response_larger_than_the_store_is_not_kept():
    st = ResponseStore(200)
    assert not st.put(_resp("big", 500), [], None)
    assert st.get("big") is None and st.used == 0
    assert st.put(_resp("ok"), [_item("hi")], None) and st.get("ok") is not None
    st.put(_resp("ok", 50), [_item("hi again")], None)  # the same id again: replaced, counted once
    assert len(st) == 1 and st.used == _size("ok", [_item("hi again")], 50)
    with pytest.raises(ValueError):
        ResponseStore(0)
