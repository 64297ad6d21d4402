"""Text inputs (CSV, JSON, JSON lines): their bytes (in shared memory) to a 2-D array.

Each decoder takes the object's bytes and the largest decoded array allowed, and returns
a float array with one row per example, or raises `InputError`.

Memory is bounded before it is spent. Text formats
(CSV, JSON, JSON lines) are read a window of `_WINDOW_BYTES` at a time, each window
decoded into a float32 block and counted against the limit at once; the blocks are
joined at the end. Peak: the blocks and the joined array (2 × the decoded array) plus
one window's Python objects (a few MiB), never a copy of the text or a Python object
per value of the whole input. A record longer than a window (one huge row) is read in
pieces cut after a comma.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson

from sqsinfer.compute.errors import InputError

_FLOAT32_BYTES = 4
# Text decoded at a time. Its Python objects (a list per row, a float per value) are the
# only memory beyond the array: ~40 bytes per value, so a few MiB. It is also the
# longest single value (one number, one CSV cell) accepted.
_WINDOW_BYTES = 1 << 17
# Room around the rows of a {"rows": [...]} object: other keys are parsed as objects.
_JSON_WRAPPER_MAX_BYTES = 1 << 16

# Line ends: str.splitlines' for CSV (as the decoder always split), \n and \r for JSONL.
_CSV_LINE_ENDS: tuple[bytes, ...] = (b"\n", b"\r", b"\x0b", b"\x0c", b"\x1c", b"\x1d", b"\x1e")
_CSV_LINE_ENDS += tuple(c.encode() for c in "\x85\u2028\u2029")
_JSONL_LINE_ENDS = (b"\n", b"\r")
_JSON_SPACE = b" \t\n\r"
_ASCII_BLANK = b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"  # what str.strip() removes, in ASCII
# Skipped before a CSV's first line: line ends, and spaces float() ignores (not \x1c-\x1f,
# which str.strip() removes but float() refuses).
_LEADING_SPACE = b" \t\n\r\x0b\x0c\x1c\x1d\x1e"
# CSV text made only of these bytes may be parsed as JSON numbers: for them JSON's
# grammar is a subset of float()'s, so the fast path never accepts what float() refuses.
_CSV_FAST_BYTES = b"0123456789+-.eE, \t\r\n"
_EMPTY_CELL = re.compile(rb"(?<=[\[,])[ \t\r]*(?=[,\]])")
_ROWS_KEY = re.compile(rb'"rows"[ \t\n\r]*:[ \t\n\r]*\[')
_ROWS_SENTINEL = b'"\\u0000rows"'


# -- text: rows gathered as float32 blocks, bounded as they come ---------------------------
class _Rows:
    """The rows decoded so far, refused as soon as they would pass the limit."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.blocks: list[np.ndarray] = []
        self.pieces: list[np.ndarray] = []  # of a row too long for one window
        self.columns = 0
        self.count = 0
        self.nbytes = 0

    def add_block(self, values: np.ndarray) -> None:
        """Whole rows (a 2-D block)."""
        if values.ndim != 2:
            raise InputError("undecodable_input", f"expected a 2-D array, got {values.ndim}-D")
        if self.pieces:
            raise InputError("undecodable_input", "rows are not numeric arrays of one shape")
        self._columns(values.shape[1])
        self.blocks.append(self._narrow(values))
        self.count += values.shape[0]

    def add_piece(self, values: np.ndarray) -> None:
        """Values of the row being read (1-D), more to come."""
        if values.ndim != 1:
            got = "3-D" if values.ndim == 2 else f"{values.ndim + 1}-D"
            raise InputError("undecodable_input", f"expected a 2-D array, got {got}")
        self.pieces.append(self._narrow(values))

    def end_row(self) -> None:
        row = self.pieces[0] if len(self.pieces) == 1 else np.concatenate(self.pieces)
        self.pieces = []
        self._columns(row.size)
        self.blocks.append(row.reshape(1, -1))
        self.count += 1

    def array(self, none: str) -> np.ndarray:
        """All rows as one float32 array; `none` says why there is nothing."""
        if self.pieces:
            self.end_row()  # one row given flat
        if not self.blocks:
            raise InputError("undecodable_input", none)
        joined = self.blocks[0] if len(self.blocks) == 1 else np.concatenate(self.blocks)
        self.blocks = []
        return joined

    def _columns(self, n: int) -> None:
        if n == 0:
            raise InputError("undecodable_input", "empty array: a row has no values")
        if self.columns and n != self.columns:
            raise InputError("undecodable_input", "rows have different numbers of columns")
        self.columns = n

    def _narrow(self, values: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # beyond float32's range becomes inf, refused below
            narrowed = values.astype(np.float32)
        self.nbytes += narrowed.nbytes
        if self.nbytes > self.max_bytes:
            raise InputError("input_too_large", f"decoded array passes {self.max_bytes} bytes")
        if np.isinf(narrowed).any():
            raise InputError("undecodable_input", "input contains infinity")
        return narrowed


class _Cut(enum.Enum):
    RECORDS = "records"  # whole records (lines, or JSON rows), the last maybe unterminated
    PIECE = "piece"  # part of a record longer than a window, cut before a comma
    LAST = "last"  # the end of such a record, without its terminator


def _frames(
    buf: memoryview, start: int, stop: int, ends: tuple[bytes, ...], unclosed: str = ""
) -> Iterator[tuple[_Cut, bytes]]:
    """The text in [start, stop) a window at a time, cut where records end.

    A window holding a record's end yields the whole records in it (with their
    terminators); one that does not is inside a long record and yields a piece cut
    before its last comma (the comma is dropped), until the record's end. A long record
    that reaches `stop` without its end is refused with `unclosed` when it is given.
    """
    pos, inside = start, False
    while pos < stop:
        window = bytes(buf[pos : min(stop, pos + _WINDOW_BYTES)])
        final = pos + len(window) >= stop
        if inside:
            at, after = _first_end(window, ends)
            if at < 0 and final and unclosed:
                raise InputError("undecodable_input", unclosed)
            if at >= 0 or final:
                yield _Cut.LAST, window[: at if at >= 0 else len(window)]
                pos, inside = pos + (after if at >= 0 else len(window)), False
                continue
        else:
            cut = len(window) if final else _last_end(window, ends)
            if cut > 0:
                yield _Cut.RECORDS, window[:cut]
                pos += cut
                continue
        comma = window.rfind(b",")
        if comma < 0:
            raise InputError("undecodable_input", f"a value is longer than {_WINDOW_BYTES} bytes")
        yield _Cut.PIECE, window[:comma]
        pos, inside = pos + comma + 1, True


def _last_end(window: bytes, ends: tuple[bytes, ...]) -> int:
    """Where the text after the last record end in `window` begins (0: no end in it)."""
    return max((i + len(end) for end in ends if (i := window.rfind(end)) >= 0), default=0)


def _first_end(window: bytes, ends: tuple[bytes, ...]) -> tuple[int, int]:
    """Where the first record end in `window` is, and where the text after it begins."""
    found = [(i, i + len(end)) for end in ends if (i := window.find(end)) >= 0]
    return min(found) if found else (-1, -1)


def _numbers(text: bytes, what: str) -> np.ndarray:
    """`text` (JSON values separated by commas) as a float64 array."""
    try:
        values = orjson.loads(b"[" + text + b"]")
    except orjson.JSONDecodeError as exc:
        raise InputError("undecodable_input", f"invalid {what}: {exc}") from None
    return _as_floats(values)


def _as_floats(values: list[Any]) -> np.ndarray:
    try:
        return np.asarray(values, dtype=np.float64)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InputError("undecodable_input", f"rows are not numeric arrays: {exc}") from None


# -- CSV ----------------------------------------------------------------------------------
def decode_csv(buf: memoryview, max_bytes: int) -> np.ndarray:
    rows = _Rows(max_bytes)
    for cut, text in _frames(buf, _csv_data_start(buf), len(buf), _CSV_LINE_ENDS):
        if cut is _Cut.RECORDS:
            block = _csv_lines(text, rows.count + 1)
            if block is not None:
                rows.add_block(block)
        else:
            rows.add_piece(_csv_cells(text, rows.count + 1))
            if cut is _Cut.LAST:
                rows.end_row()
    return rows.array("CSV has no data rows")


def _csv_data_start(buf: memoryview) -> int:
    """Where the data begins: after the first non-blank line when it is a header."""
    pos = 0
    while (pos := _skip(buf, pos, len(buf), _LEADING_SPACE)) < len(buf):
        cut, text = next(_frames(buf, pos, len(buf), _CSV_LINE_ENDS))
        if cut is not _Cut.RECORDS:  # a first line longer than a window
            return _after_long_header(buf, pos)
        for line in _utf8(text).splitlines(keepends=True):
            if line.strip():  # its cells are tested without the line end, as always
                return pos if _numeric(line.splitlines()[0]) else pos + len(line.encode())
            pos += len(line.encode())
    return pos


def _after_long_header(buf: memoryview, pos: int) -> int:
    """`pos`, or the end of the long line there when a cell of it is not a number."""
    for cut, text in _frames(buf, pos, len(buf), _CSV_LINE_ENDS):
        if not _numeric(_utf8(text)):
            return _end_of_line(buf, pos)
        if cut is not _Cut.PIECE:
            break
    return pos


def _numeric(line: str) -> bool:
    try:
        [float(cell) for cell in line.split(",") if cell.strip()]
    except ValueError:
        return False
    return True


def _end_of_line(buf: memoryview, pos: int) -> int:
    """Where the line holding `pos` ends (after its terminator)."""
    while pos < len(buf):
        window = bytes(buf[pos : pos + _WINDOW_BYTES])
        at, after = _first_end(window, _CSV_LINE_ENDS)
        if at >= 0:
            return pos + after
        pos += len(window)
    return pos


def _csv_lines(text: bytes, first_row: int) -> np.ndarray | None:
    """Whole CSV lines as a 2-D float64 array; None when all are blank."""
    if not text.strip(_ASCII_BLANK):
        return None
    if not text.translate(None, _CSV_FAST_BYTES) and text.count(b"\r") == text.count(b"\r\n"):
        lines = [line for line in text.split(b"\n") if line.strip()]
        if not lines:
            return None
        cells = text.count(b",") + len(lines)
        fast = _fast_numbers(b"[[" + b"],[".join(lines) + b"]]", cells)
        if fast is not None and fast.ndim == 2:
            return fast
    rows: list[list[float]] = []
    for line in _utf8(text).splitlines():
        if line.strip():
            rows.append(_cells(line, first_row + len(rows)))
    if not rows:
        return None
    if len({len(r) for r in rows}) > 1:
        raise InputError("undecodable_input", "CSV rows have different numbers of columns")
    return np.array(rows, dtype=np.float64)


def _csv_cells(text: bytes, row: int) -> np.ndarray:
    """Cells of one line (or a piece of one) as a 1-D float64 array."""
    if not text.translate(None, _CSV_FAST_BYTES):
        fast = _fast_numbers(b"[" + text + b"]", text.count(b",") + 1)
        if fast is not None and fast.ndim == 1:
            return fast
    return np.array(_cells(_utf8(text), row), dtype=np.float64)


def _cells(line: str, row: int) -> list[float]:
    """One line's cells, as CSV inputs have always been read: blank is missing (NaN)."""
    try:
        return [float(cell) if cell.strip() else math.nan for cell in line.split(",")]
    except ValueError:
        raise InputError("undecodable_input", f"CSV data row {row} is not numeric") from None


def _fast_numbers(text: bytes, cells: int) -> np.ndarray | None:
    """CSV numbers parsed as JSON (in C), or None to read them cell by cell.

    Empty cells are missing values: made `null` (NaN to numpy), first by plain
    replacement, then, for cells of spaces, by a slower pattern.
    """
    for fill in (_as_is, _null_empty_cells, _null_blank_cells):
        try:
            values = orjson.loads(fill(text))
            array = np.asarray(values, dtype=np.float64)
        except (orjson.JSONDecodeError, ValueError, TypeError):
            continue
        return array if array.size == cells else None
    return None


def _as_is(text: bytes) -> bytes:
    return text


def _null_empty_cells(text: bytes) -> bytes:
    text = text.replace(b"[,", b"[null,").replace(b",]", b",null]")
    for _ in range(2):  # in a run of empty cells the first pass skips every other one
        text = text.replace(b",,", b",null,")
    return text


def _null_blank_cells(text: bytes) -> bytes:
    return _EMPTY_CELL.sub(b"null", text)


def _utf8(text: bytes) -> str:
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError("undecodable_input", f"CSV is not UTF-8: {exc}") from None


def _skip(buf: memoryview, pos: int, stop: int, space: bytes) -> int:
    """The first position in [pos, stop) that is not one of `space`."""
    while pos < stop:
        window = bytes(buf[pos : min(stop, pos + _WINDOW_BYTES)])
        kept = len(window.lstrip(space))
        if kept:
            return pos + len(window) - kept
        pos += len(window)
    return stop


def _skip_back(buf: memoryview, stop: int, space: bytes) -> int:
    """Just after the last position before `stop` that is not one of `space`."""
    while stop > 0:
        window = bytes(buf[max(0, stop - _WINDOW_BYTES) : stop])
        kept = len(window.rstrip(space))
        if kept:
            return stop - len(window) + kept
        stop -= len(window)
    return 0


# -- JSON lines ---------------------------------------------------------------------------
def decode_jsonl(buf: memoryview, max_bytes: int) -> np.ndarray:
    rows = _Rows(max_bytes)
    flat: bool | None = None  # lines of single numbers are one row, like a flat JSON array
    for cut, text in _frames(buf, 0, len(buf), _JSONL_LINE_ENDS):
        if cut is _Cut.RECORDS:
            values = _jsonl_lines(text)
            if values is None:
                continue
            flat = _same_kind(flat, values.ndim == 1)
            (rows.add_piece if flat else rows.add_block)(values)
        else:
            flat = _same_kind(flat, False)
            rows.add_piece(_row_piece(text, cut, not rows.pieces, "JSON line", closed=True))
            if cut is _Cut.LAST:
                rows.end_row()
    return rows.array("expected a non-empty JSON array of rows")


def _jsonl_lines(text: bytes) -> np.ndarray | None:
    if not text.strip():
        return None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        values = [orjson.loads(line) for line in lines]
    except orjson.JSONDecodeError as exc:
        raise InputError("undecodable_input", f"invalid JSON line: {exc}") from None
    return _as_floats(values)


def _same_kind(flat: bool | None, now: bool) -> bool:
    if flat is not None and flat != now:
        raise InputError("undecodable_input", "rows are not numeric arrays of one shape")
    return now


def _row_piece(text: bytes, cut: _Cut, first: bool, what: str, *, closed: bool) -> np.ndarray:
    """Values of a piece of one long row: `[` before the first, `]` after the last when
    `closed` (JSON lines; a JSON array's frames stop before it)."""
    if first:
        text = text.lstrip(_JSON_SPACE)
        if not text.startswith(b"["):
            raise InputError("undecodable_input", f"invalid {what}: a long row is not an array")
        text = text[1:]
    if cut is _Cut.LAST and closed:
        text = text.rstrip(_JSON_SPACE)
        if not text.endswith(b"]"):
            raise InputError("undecodable_input", f"invalid {what}: a long row is not closed")
        text = text[:-1]
    values = _numbers(text, what)
    if values.size == 0:  # a piece ends at a comma, or follows one: a value must be there
        raise InputError("undecodable_input", f"invalid {what}: a value is missing")
    return values


# -- JSON ---------------------------------------------------------------------------------
def decode_json(buf: memoryview, max_bytes: int) -> np.ndarray:
    start, stop = _json_rows_span(buf)
    first = _skip(buf, start, stop, _JSON_SPACE)
    if first >= stop:
        raise InputError("undecodable_input", "expected a non-empty JSON array of rows")
    rows = _Rows(max_bytes)
    if buf[first] != ord("["):  # numbers: one row given flat
        for _, text in _frames(buf, first, stop, ()):
            values = _numbers(text, "JSON")
            if values.size == 0:
                raise InputError("undecodable_input", "invalid JSON: a value is missing")
            rows.add_piece(values)
    else:
        _json_rows(buf, first, stop, rows)
    return rows.array("expected a non-empty JSON array of rows")


def _json_rows(buf: memoryview, first: int, stop: int, rows: _Rows) -> None:
    """The rows `[..], [..]` in [first, stop): windows cut after a row's `]`."""
    after_row = False  # a comma must come next
    # A row's `]` ends it: one missing, the document was cut short after another row's.
    for cut, text in _frames(buf, first, stop, (b"]",), "invalid JSON: a row is not closed"):
        starts = cut is _Cut.RECORDS or not rows.pieces  # a row begins in it
        body = _json_separator(text, after_row) if starts else text
        if cut is _Cut.RECORDS:
            if body is not None:
                rows.add_block(_numbers(body, "JSON"))
                after_row = True
            continue
        rows.add_piece(_row_piece(body or b"", cut, starts, "JSON", closed=False))
        if cut is _Cut.LAST:
            rows.end_row()
            after_row = True


def _json_separator(text: bytes, after_row: bool) -> bytes | None:
    """`text` without the comma that separates it from the row before (None: only space)."""
    text = text.lstrip(_JSON_SPACE)
    if not text:
        return None
    if after_row:
        if not text.startswith(b","):
            raise InputError("undecodable_input", "invalid JSON: rows must be separated by ','")
        text = text[1:]
        if not text.strip(_JSON_SPACE):
            raise InputError("undecodable_input", "invalid JSON: a row is missing after ','")
    return text


def _json_rows_span(buf: memoryview) -> tuple[int, int]:
    """Where the rows lie: inside a top-level array, or the "rows" array of an object."""
    first = _skip(buf, 0, len(buf), _JSON_SPACE)
    last = _skip_back(buf, len(buf), _JSON_SPACE)
    if first < last and buf[first] == ord("["):
        if buf[last - 1] != ord("]"):
            raise InputError("undecodable_input", "invalid JSON: the array is not closed")
        return first + 1, last - 1
    if first < last and buf[first] == ord("{"):
        return _rows_in_object(buf, first, last)
    raise InputError("undecodable_input", "expected a non-empty JSON array of rows")


def _rows_in_object(buf: memoryview, first: int, last: int) -> tuple[int, int]:
    """The content of the object's top-level "rows" array.

    Everything around it (other keys) is parsed as objects, so it is held to
    `_JSON_WRAPPER_MAX_BYTES`. A candidate is the top-level "rows" when the object, with
    that array replaced by a sentinel, has the sentinel as its "rows".
    """
    head = bytes(buf[first : min(last, first + _JSON_WRAPPER_MAX_BYTES)])
    for match in list(_ROWS_KEY.finditer(head))[:8]:
        opening = first + match.end() - 1
        closing = _closing_bracket(buf, opening, last)
        if closing < 0 or (opening - first) + (last - closing) > _JSON_WRAPPER_MAX_BYTES:
            continue
        wrapper = bytes(buf[first:opening]) + _ROWS_SENTINEL + bytes(buf[closing + 1 : last])
        try:
            doc = orjson.loads(wrapper)
        except orjson.JSONDecodeError:
            continue
        if isinstance(doc, dict) and doc.get("rows") == "\x00rows":
            return opening + 1, closing
    raise InputError(
        "undecodable_input",
        'expected a non-empty JSON array of rows, or {"rows": [...]} with at most '
        f"{_JSON_WRAPPER_MAX_BYTES} bytes around the rows",
    )


def _closing_bracket(buf: memoryview, opening: int, stop: int) -> int:
    """The `]` that closes the `[` at `opening` (brackets counted a window at a time)."""
    depth, pos = 0, opening
    while pos < stop:
        window = np.frombuffer(buf[pos : min(stop, pos + _WINDOW_BYTES)], dtype=np.uint8)
        levels = np.cumsum((window == ord("[")).astype(np.int64) - (window == ord("]")))
        levels += depth
        hits = np.flatnonzero(levels == 0)
        if hits.size:
            return pos + int(hits[0])
        depth = int(levels[-1])
        pos += window.size
    return -1
