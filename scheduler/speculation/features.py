"""A request's target features, kept as raw bytes for a draft that reads them (an EAGLE-style head).

The scheduler never decodes them: it appends the rows each step returns and sends a
draft service the rows it does not hold yet. Rows cover positions 0 .. count-1 with no
gap; a step that recomputes earlier positions (after a worker was lost) overwrites them.
"""

from __future__ import annotations

from proto.messages import FeatureRows

_ITEM_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}


class FeatureStore:
    def __init__(self) -> None:
        self._data = bytearray()
        self._width = 0
        self._dtype = ""
        self.count = 0  # rows held: positions 0 .. count-1

    def problem(self, rows: FeatureRows) -> str:
        """Why these rows cannot be stored ("" if they can)."""
        size = _ITEM_SIZES.get(rows.dtype)
        if size is None:
            return f"feature dtype {rows.dtype!r} is unknown"
        if rows.num_rows < 0 or rows.width <= 0 or len(rows.data) != rows.num_rows * rows.width * size:
            return f"{len(rows.data)} bytes of features do not make ({rows.num_rows}, {rows.width}) {rows.dtype}"
        if self.count and rows.start_position > 0 and (rows.width, rows.dtype) != (self._width, self._dtype):
            return f"features of ({rows.width}, {rows.dtype}) after ({self._width}, {self._dtype})"
        if rows.start_position < 0:
            return f"features at position {rows.start_position}"
        return ""

    def put(self, rows: FeatureRows) -> bool:
        """Store rows (checked with `problem` first); False, storing nothing, when they would leave a gap."""
        if rows.start_position > self.count:
            return False
        self._width, self._dtype = rows.width, rows.dtype
        row_bytes = rows.width * _ITEM_SIZES[rows.dtype]
        del self._data[rows.start_position * row_bytes :]
        self._data += rows.data
        self.count = rows.start_position + rows.num_rows
        return True

    def rows_from(self, start: int, stop: int) -> FeatureRows:
        """Positions start .. stop-1 (within 0 .. count)."""
        assert 0 <= start <= stop <= self.count, (start, stop, self.count)
        row_bytes = self._width * _ITEM_SIZES.get(self._dtype, 0)
        return FeatureRows(
            start, stop - start, self._width, self._dtype, bytes(self._data[start * row_bytes : stop * row_bytes])
        )

    def clear(self) -> None:
        self._data.clear()
        self.count = 0
