"""Hypothesis strategies for malformed ZeroMQ frames, shared by the fuzz tests of every socket.

What a socket may receive that is not a well-formed message for it: garbage bytes,
truncated msgpack, valid msgpack of the wrong schema, an unknown message tag, a known
tag with wrong or missing fields, and well-formed messages of another direction.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from hypothesis import strategies as st

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=16)
    | st.binary(max_size=16)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _truncations(frame: bytes) -> st.SearchStrategy[bytes]:
    return st.integers(0, max(len(frame) - 1, 0)).map(lambda n: frame[:n])


def _with_a_field_broken(frame: bytes) -> st.SearchStrategy[bytes]:
    fields: dict[str, object] = msgspec.msgpack.decode(frame)
    names = [name for name in fields if name != "type"]
    if not names:
        return st.just(msgspec.msgpack.encode({**fields, "unexpected": 1}))
    return st.tuples(st.sampled_from(names), _values, st.booleans()).map(
        lambda change: msgspec.msgpack.encode(
            {k: v for k, v in fields.items() if k != change[0]} if change[2] else {**fields, change[0]: change[1]}
        )
    )


def malformed_frames(
    right: Sequence[msgspec.Struct], other_directions: Sequence[msgspec.Struct], *, mutate: bool = True
) -> st.SearchStrategy[bytes]:
    """Frames a socket whose union `right` samples must refuse (count, log once, drop).

    With `mutate`, also messages of the right type with a field removed or replaced: most
    are invalid, but a replacement can happen to be valid, so use it only where a valid
    message is dropped anyway (a sender that never said hello, an unknown worker id).
    """
    encoded = [msgspec.msgpack.encode(message) for message in right]
    strategies = [
        st.binary(max_size=256),
        st.sampled_from(encoded).flatmap(_truncations),
        _values.map(msgspec.msgpack.encode),
        st.tuples(st.text(min_size=1, max_size=12), st.dictionaries(st.text(max_size=8), _values, max_size=3)).map(
            lambda tag_fields: msgspec.msgpack.encode({**tag_fields[1], "type": "fuzz-" + tag_fields[0]})
        ),
        st.sampled_from([msgspec.msgpack.encode(message) for message in other_directions]),
    ]
    if mutate:
        strategies.append(st.sampled_from(encoded).flatmap(_with_a_field_broken))
    return st.one_of(*strategies)
