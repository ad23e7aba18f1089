"""The depth-first cycle finder of the import checks in tests/unit (test_architecture.py:
modules, test_layers.py: packages). A plain module beside them, not a test file."""

from __future__ import annotations


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (``{node: nodes it points to}``) as ``[a, b, ..., a]``, or []
    (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return []
