"""How deep a JSON text nests arrays and objects, found without parsing it: a check that itself cannot recurse.

Python's `json` recurses once per level (a text 50,000 arrays deep is a RecursionError) and
so do the parsers behind it (llguidance's serde_json refuses past 128 levels with a
ValueError), so a text from a client is measured with this before any of them sees it.
"""

from __future__ import annotations

import numpy as np

_QUOTE = ord('"')
# By byte: +1 opens an array or object, -1 closes one.
_DEPTH_STEPS = np.array([1 if byte in b"[{" else -1 if byte in b"]}" else 0 for byte in range(256)], dtype=np.int8)
_DEPTH_CHUNK = 2**20  # bytes summed at a time: bounds the memory a check takes


def nests_deeper_than(text: str, max_depth: int) -> bool:
    """Whether arrays and objects in `text` nest deeper than max_depth; brackets inside strings do not count.

    The depth at each byte is a running sum (+1 per opener, -1 per closer, outside strings), and whether a byte is
    inside a string is the parity of the quotes before it, once escaped backslashes and quotes are gone. Both sums
    are taken with numpy a chunk at a time: a text of many brackets costs about what parsing it does, and nothing
    recurses. A text that is not JSON gets an answer too (its parser then says what is wrong with it).
    """
    if text.count("[") + text.count("{") <= max_depth:
        return False  # the usual text: too few brackets to nest that deep (counted without copying it)
    unescaped = text.encode("utf-8", "surrogatepass").replace(b"\\\\", b"").replace(b'\\"', b"")
    data = np.frombuffer(unescaped, dtype=np.uint8)
    num_quotes, depth = 0, 0
    for start in range(0, len(data), _DEPTH_CHUNK):
        chunk = data[start : start + _DEPTH_CHUNK]  # [C] bytes
        quotes = np.cumsum(chunk == _QUOTE, dtype=np.int64) + num_quotes  # [C] quotes up to each byte
        steps = np.where(quotes % 2 == 0, _DEPTH_STEPS[chunk], 0)  # [C] an opening quote is odd: inside
        depths = np.cumsum(steps, dtype=np.int64) + depth  # [C]
        if depths.max() > max_depth:
            return True
        num_quotes, depth = int(quotes[-1]), int(depths[-1])
    return False
