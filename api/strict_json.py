"""Reads a request body as JSON the way the contract needs it: every key once, every number finite,
every string valid Unicode, nesting bounded. Python's parser lets all of these through silently (the
last duplicate wins, NaN and 1e400 become floats, lone surrogates pass), so such a body is refused
here, naming the offending value, before any model sees it."""

from __future__ import annotations

import json
import math
from typing import Any

from common.contract import echo

MAX_DEPTH = 64
"""Objects and arrays nested deeper than this are refused: nothing in a request needs more, and
serialisers further down (pydantic, orjson) give up not far above it."""

Loc = list[str | int]


class BodyRejected(Exception):
    """A body that is not acceptable JSON; `loc` (after "body") and `kind` as in a 422 detail item."""

    def __init__(self, loc: Loc, message: str, kind: str, status: int = 422) -> None:
        super().__init__(message)
        self.loc: Loc = [printable(step) if isinstance(step, str) else step for step in loc]
        self.message = message
        self.kind = kind
        self.status = status


def read_json(raw: bytes) -> Any:
    """Parse `raw` as UTF-8 JSON, or raise `BodyRejected` saying what is wrong and where."""
    try:
        value = json.loads(raw, object_pairs_hook=_object, parse_constant=_NonFinite, parse_float=_float)
    except json.JSONDecodeError as exc:
        raise BodyRejected([exc.pos], f"invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                           "json_invalid") from None
    except UnicodeDecodeError:
        raise BodyRejected([], "the body is not valid UTF-8", "encoding_error", status=400) from None
    except RecursionError:
        raise BodyRejected([], f"JSON nested deeper than {MAX_DEPTH} levels", "json_too_deep") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise BodyRejected([], f"invalid JSON: {exc}", "json_invalid") from None
    _check(value)
    return value


PARSED_BODY = "json_body"
"""The key under which BodyGate (api/middleware.py) leaves the body it parsed in the request's state."""

def printable(text: str) -> str:
    """`text` with any lone surrogate written as `\\udxxx`, so it can be quoted back in an error."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class _NonFinite(str):
    """NaN, ±Infinity or a number too large for a double (1e400), kept as its text to be refused."""


class _Duplicated(dict[str, Any]):
    """An object that named `duplicate` more than once."""

    duplicate: str


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    duplicated = _Duplicated(obj)
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            duplicated.duplicate = key
            break
        seen.add(key)
    return duplicated


def _float(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _check(root: Any) -> None:
    # Iterative, so a body at the nesting limit cannot exhaust the stack here either.
    stack: list[tuple[Any, Loc, int]] = [(root, [], 0)]
    while stack:
        value, loc, depth = stack.pop()
        if isinstance(value, _NonFinite):
            raise BodyRejected(loc, f"{_path(loc)}: {value} is not a finite number; JSON numbers must be finite "
                               "(NaN, Infinity and numbers beyond a double's range cannot be echoed back)",
                               "finite_number")
        if isinstance(value, str):
            _require_unicode(value, loc)
        elif isinstance(value, dict | list):
            if depth >= MAX_DEPTH:
                raise BodyRejected(loc, f"JSON nested deeper than {MAX_DEPTH} levels", "json_too_deep")
            if isinstance(value, _Duplicated):
                raise BodyRejected([*loc, value.duplicate], f"{_path(loc)}: the key {echo(value.duplicate)!r} "
                                   "appears more than once; every key in an object must be unique", "duplicate_key")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _require_unicode(key, [*loc, key])
                stack.append((item, [*loc, key], depth + 1))


def _require_unicode(text: str, loc: Loc) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise BodyRejected(loc, f"{_path(loc)}: contains an unpaired UTF-16 surrogate "
                           f"({printable(text[error.start])}); send valid Unicode", "unicode_error") from None


def _path(loc: Loc) -> str:
    # ["questions", "q", "criteria", 2] → "body.questions.q.criteria[2]"
    path = "body"
    for step in loc:
        path += f"[{step}]" if isinstance(step, int) else f".{printable(step)}"
    return path
