"""Dependencies between loads: the cycle a new or replaced load would close."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


def find_cycle(name: str, depends_on: Sequence[str], edges: Callable[[str], Iterable[str]]) -> list[str] | None:
    """The cycle ``name`` -> ... -> ``name`` that adding ``name`` with ``depends_on`` would create, or None.

    ``edges(n)`` gives the dependencies of the loads already known, whose graph
    is acyclic (every load went through this check), so only paths back to
    ``name`` can close a cycle.
    """
    seen: set[str] = set()
    # Depth-first with an explicit stack of (node, path to it): no recursion limit.
    stack: list[tuple[str, list[str]]] = [(dep, [name, dep]) for dep in reversed(depends_on)]
    while stack:
        node, path = stack.pop()
        if node == name:
            return path
        if node in seen:
            continue
        seen.add(node)
        stack.extend((nxt, [*path, nxt]) for nxt in reversed(list(edges(node))))
    return None


def render_cycle(cycle: Sequence[str]) -> str:
    return " -> ".join(cycle)
