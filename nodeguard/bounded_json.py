"""A short JSON rendering of any value, for error messages: bounded in length and depth, whatever the input.

``json.dumps`` of a client's or a config file's value can raise (a thousand
levels of nesting exhaust the recursion limit) or produce megabytes; an error
message needs neither.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

MAX_DEPTH = 6


class _Full(Exception):
    pass


def bounded_json(value: object, limit: int = 80) -> str:
    """At most ``limit`` characters of ``value`` as JSON; longer or deeper parts end in '...'."""
    parts: list[str] = []
    size = 0

    def put(text: str) -> None:
        nonlocal size
        parts.append(text)
        size += len(text)
        if size > limit:
            raise _Full

    def walk(item: object, depth: int) -> None:
        if isinstance(item, Mapping | list | tuple) and depth >= MAX_DEPTH:
            put("{...}" if isinstance(item, Mapping) else "[...]")
        elif isinstance(item, Mapping):
            put("{")
            for i, (key, val) in enumerate(item.items()):
                put(("," if i else "") + _scalar(key if isinstance(key, str) else str(key), limit) + ":")
                walk(val, depth + 1)
            put("}")
        elif isinstance(item, list | tuple):
            put("[")
            for i, val in enumerate(item):
                if i:
                    put(",")
                walk(val, depth + 1)
            put("]")
        else:
            put(_scalar(item, limit))

    try:
        walk(value, 0)
    except _Full:
        text = "".join(parts)
        return text[: max(0, limit - 3)] + "..."
    return "".join(parts)


def _scalar(item: object, limit: int) -> str:
    if isinstance(item, str):
        return json.dumps(item[: limit + 1])
    if item is None or isinstance(item, bool | float):
        return json.dumps(item)
    if isinstance(item, int):
        try:
            return str(item)
        except ValueError:  # more digits than int->str conversion allows
            return f"<an integer of {item.bit_length()} bits>"
    try:
        return repr(item)[: limit + 1]
    except Exception:  # a value whose repr fails still gets a message
        return f"<{type(item).__name__}>"
