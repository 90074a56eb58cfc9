"""A state machine's graph as the Step Functions console's graph view draws it, for the console.

The graph is drawn from the ASL definition the execution ran (DescribeStateMachineForExecution):
one node per state, Map and Parallel states as boxes holding their inner states, an edge per
transition (``Next``, a Choice's ``Choices`` and ``Default``, a ``Catch``'s ``Next``), and the
Start and End nodes the console adds. Each state gets one of the statuses the console's Graph view
colours states by (in progress, succeeded, failed, cancelled, caught error; https://docs.aws.amazon.
com/step-functions/latest/dg/exec-details-interface-overview.html), read off the execution's history: a state is
entered and exited once per visit (``stateEnteredEventDetails`` / ``stateExitedEventDetails``
carry its name; https://docs.aws.amazon.com/step-functions/latest/apireference/API_HistoryEvent.html).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from stagecoach.inspect.events import failed_tasks

START, END = "__start__", "__end__"
NOT_STARTED, IN_PROGRESS, SUCCEEDED, FAILED, CANCELLED, CAUGHT = (
    "NOT_STARTED",
    "IN_PROGRESS",
    "SUCCEEDED",
    "FAILED",
    "CANCELLED",
    "CAUGHT_ERROR",
)
# a Map or Parallel state's failure event carries no state name: it is the innermost open state of its type
_CONTAINER_FAILURES = {"MapStateFailed": "Map", "ParallelStateFailed": "Parallel"}


def _walk(states: dict[str, Any], parent: str | None) -> Iterator[tuple[str, dict[str, Any], str | None]]:
    """Every state with the Map or Parallel state holding it (None at the top), depth first."""
    for name, state in states.items():
        yield name, state, parent
        inner = state.get("ItemProcessor") or state.get("Iterator")  # Iterator: the older name of ItemProcessor
        if inner:
            yield from _walk(inner.get("States", {}), name)
        for branch in state.get("Branches", []):
            yield from _walk(branch.get("States", {}), name)


def _targets(state: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(next state, kind) of each transition out of a state."""
    if state.get("Next"):
        yield state["Next"], "next"
    for choice in state.get("Choices", []):
        if choice.get("Next"):
            yield choice["Next"], "choice"
    if state.get("Default"):
        yield state["Default"], "default"
    for catch in state.get("Catch", []):
        if catch.get("Next"):
            yield catch["Next"], "catch"


def elements(definition: dict[str, Any]) -> list[dict[str, Any]]:
    """Cytoscape elements (``{"data": ...}``) of an ASL definition: nodes, then edges."""
    nodes: list[dict[str, Any]] = [{"data": {"id": START, "label": "Start", "type": "Start"}}]
    edges: list[dict[str, Any]] = [{"data": {"id": f"{START}->{definition['StartAt']}", "source": START, "target": definition["StartAt"]}}]
    ends = False
    for name, state, parent in _walk(definition.get("States", {}), None):
        node = {"id": name, "label": name, "type": state.get("Type", "?")}
        if parent is not None:
            node["parent"] = parent
        nodes.append({"data": node})
        for target, kind in _targets(state):
            edges.append({"data": {"id": f"{name}->{target}:{kind}", "source": name, "target": target, "kind": kind}})
        if parent is None and (state.get("End") or state.get("Type") in ("Succeed", "Fail")):
            ends = True
            edges.append({"data": {"id": f"{name}->{END}", "source": name, "target": END}})
    if ends:
        nodes.append({"data": {"id": END, "label": "End", "type": "End"}})
    return nodes + edges


def _state_types(definition: dict[str, Any]) -> dict[str, str]:
    return {name: str(state.get("Type", "?")) for name, state, _ in _walk(definition.get("States", {}), None)}


def state_statuses(definition: dict[str, Any], events: list[dict[str, Any]], execution_status: str) -> dict[str, str]:
    """Each state's status in one execution, as the console's graph view colours it.

    Not entered: NOT_STARTED. Entered more often than exited: IN_PROGRESS while the execution
    runs, FAILED once it failed or timed out, CANCELLED once it was aborted (or ended past it). A
    Fail state entered: FAILED. Every visit exited, with a failure on the way (a retried task, a
    caught error): CAUGHT_ERROR; without: SUCCEEDED.
    """
    types = _state_types(definition)
    entered: Counter[str] = Counter()
    exited: Counter[str] = Counter()
    failures: Counter[str] = Counter(f.state for f in failed_tasks(events, ""))
    open_states: list[str] = []
    for e in events:
        if name := (e.get("stateEnteredEventDetails") or {}).get("name"):
            entered[name] += 1
            open_states.append(name)
        elif name := (e.get("stateExitedEventDetails") or {}).get("name"):
            exited[name] += 1
            if name in open_states:
                open_states.reverse()
                open_states.remove(name)  # its latest visit
                open_states.reverse()
        elif kind := _CONTAINER_FAILURES.get(e["type"]):
            holder = next((n for n in reversed(open_states) if types.get(n) == kind), None)
            if holder is not None:
                failures[holder] += 1
    out: dict[str, str] = {}
    for name, typ in types.items():
        out[name] = _status(entered[name], exited[name], failures[name], typ, execution_status)
    return out


def _status(entered: int, exited: int, failures: int, typ: str, execution_status: str) -> str:
    if entered == 0:
        return NOT_STARTED
    if typ == "Fail":
        return FAILED
    if entered > exited:
        if execution_status == "RUNNING":
            return IN_PROGRESS
        return FAILED if execution_status in ("FAILED", "TIMED_OUT") else CANCELLED
    return CAUGHT if failures else SUCCEEDED
