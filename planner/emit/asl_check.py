"""A structural check of ASL definitions: sdk/deploy/start.py runs it on a job's window state
machine before creating it, and tests/test_asl.py on every emitted definition (the job state
machine is deployed by SAM from statemachines/job.asl.json, which the tests hold equal to the emitter's).

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
        targets = _targets(st)
        if st.get("Type") == "Choice" and not st.get("Choices"):
            problems.append(f"{here}: Choice without Choices")
        problems += [f"{here}: target {tgt!r} does not exist" for tgt in targets if tgt not in states]
        problems += _state_problems(here, st)
        edges[name] = {t for t in targets if t in states}
    seen = _reachable(start, edges)
    problems += [f"{where}{name}: unreachable from StartAt" for name in states if name not in seen]
    return problems


def _targets(st: dict[str, Any]) -> set[Any]:
    """Every state ``st`` may go to: its Next, a Choice's rules and Default, its Catchers' Next
    (None where a rule or a Catcher names none, which the caller reports as a missing target)."""
    targets: set[Any] = set()
    if "Next" in st:
        targets.add(st["Next"])
    if st.get("Type") == "Choice":
        for c in st.get("Choices", []):
            targets.add(c.get("Next"))
        if "Default" in st:
            targets.add(st["Default"])
    for c in st.get("Catch", []):
        targets.add(c.get("Next"))
    return targets


def _state_problems(here: str, st: dict[str, Any]) -> list[str]:
    """What is wrong with the state itself, whatever the graph around it: how it ends, a Task's
    timeout, and the states nested in a Map or a Parallel (checked as definitions of their own)."""
    problems: list[str] = []
    typ = st.get("Type")
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
    return problems


def _reachable(start: Any, edges: dict[str, set[str]]) -> set[str]:
    """The states reachable from ``start`` along ``edges`` (none if ``start`` is not a state)."""
    seen: set[str] = set()
    todo: list[str] = [start] if isinstance(start, str) and start in edges else []
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += list(edges.get(n, ()))
    return seen
