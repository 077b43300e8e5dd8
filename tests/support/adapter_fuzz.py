"""Fuzzing helpers shared by the adapter tests (test_adapter_*.py): random JSON values, the
paths into a body (to mutate it), and the totality check every adapter must pass."""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator

from hypothesis import strategies as st

from polar_mitm.adapters import Adapter, AdapterError

# JSON as orjson reads it: integers in 64 bits, no NaN or infinity.
BOUNDED_INTS = st.integers(-2**53, 2**53)
FINITE_FLOATS = st.floats(allow_nan=False, allow_infinity=False)


def json_values(*, ints: st.SearchStrategy = st.integers(), floats: st.SearchStrategy | None = None,
                text_size: int = 8, key_size: int = 8, max_leaves: int = 10) -> st.SearchStrategy:
    """Any JSON value: scalars (floats only when given), lists and objects of at most three."""
    scalars = st.none() | st.booleans() | ints
    if floats is not None:
        scalars |= floats
    scalars |= st.text(max_size=text_size)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=key_size), inner, max_size=3),
                        max_leaves=max_leaves)


def json_paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """The path (keys and indexes) to every value inside `value`, itself first."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from json_paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from json_paths(v, prefix + (i,))


def parent_of(body: Any, path: tuple) -> Any:
    """The container holding what is at `path` (KeyError, IndexError or TypeError when an
    earlier mutation removed the path)."""
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    return parent


def check_total(adapter: Adapter, body: Any, path: str = "", *, answer: dict, streamed: dict | None = None,
                error_shape: Callable[[dict, AdapterError], bool]) -> dict | None:
    """The adapter is total over any JSON body: either a client error (an AdapterError with a
    4xx status, in the provider's error shape), or a request that is stored as JSON and
    answered, whole (with `answer`) and streamed (with `streamed`, else `answer`)."""
    try:
        req = adapter.to_chat(body, path)
    except AdapterError as e:
        assert isinstance(e, ValueError) and 400 <= e.status < 500
        err = adapter.error(e.status, str(e), e.kind)
        assert isinstance(err, dict) and error_shape(err, e), err
        return None
    assert isinstance(req, dict)
    json.dumps(req)   # storable as JSON
    assert isinstance(adapter.from_chat(answer, req), dict)
    assert b"".join(adapter.stream(streamed or answer, req))
    return req
