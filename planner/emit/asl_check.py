"""A structural check of ASL definitions, run on every emitted state machine before it is deployed.

asl-validator (npm) checks the schema; this checks the graph: every Next / Default / Catch / StartAt
target exists, every state is reachable, every non-terminal state has Next or End, and every Task
has a timeout.
"""

from __future__ import annotations

from typing import Any

TERMINAL = {"Succeed", "Fail"}


def check_definition(definition: dict[str, Any], where: str = "") -> list[str]:
    """Problems found in ``definition`` (and its nested Map processors and Parallel branches)."""
    problems: list[str] = []
    states = definition.get("States")
    if not isinstance(states, dict) or not states:
        return [f"{where or 'definition'}: no States"]
    start = definition.get("StartAt")
    if start not in states:
        problems.append(f"{where}StartAt {start!r} is not a state")
    edges: dict[str, set[str]] = {}
    for name, st in states.items():
        here = f"{where}{name}"
        typ = st.get("Type")
        targets: set[str] = set()
        if "Next" in st:
            targets.add(st["Next"])
        if typ == "Choice":
            for c in st.get("Choices", []):
                targets.add(c.get("Next"))
            if "Default" in st:
                targets.add(st["Default"])
            if not st.get("Choices"):
                problems.append(f"{here}: Choice without Choices")
        for c in st.get("Catch", []):
            targets.add(c.get("Next"))
        for tgt in targets:
            if tgt not in states:
                problems.append(f"{here}: target {tgt!r} does not exist")
        if typ not in TERMINAL and typ != "Choice":
            has_next, has_end = "Next" in st, st.get("End") is True
            if has_next == has_end:
                problems.append(f"{here}: a {typ} state needs exactly one of Next or End")
        if typ == "Task" and "TimeoutSeconds" not in st and "TimeoutSecondsPath" not in st:
            problems.append(f"{here}: Task without TimeoutSeconds")
        if typ == "Map":
            proc = st.get("ItemProcessor") or st.get("Iterator")
            if not proc:
                problems.append(f"{here}: Map without ItemProcessor")
            else:
                problems += check_definition(proc, f"{here}/")
        if typ == "Parallel":
            for i, br in enumerate(st.get("Branches", [])):
                problems += check_definition(br, f"{here}[{i}]/")
        edges[name] = {t for t in targets if t in states}
    seen: set[str] = set()
    todo: list[str] = [start] if isinstance(start, str) and start in states else []
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += list(edges.get(n, ()))
    for name in states:
        if name not in seen:
            problems.append(f"{where}{name}: unreachable from StartAt")
    return problems
