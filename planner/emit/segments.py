"""One window state machine for a plan with segments (dynamic workers, planner/segments.py).

Each segment's window graph is emitted as for a fixed plan (asl.window_definition) and the graphs
are joined into one definition: every state name gets the segment's suffix (``Gate_s1``); ``Init``
sets the window's position and lists as a fixed plan's does (sdk/deploy/resume.py rewrites its lists
of versions there), then ``Start`` enters the segment of the attempt's first iteration through its
``Enter`` (that segment's Map items), and each segment's ``Go?`` hands an iteration
outside its segment (the change point, or a redo before it) to ``Segment``, which re-enters the
right segment's ``Go?`` with that segment's Map items (its replicas) and the gate's answer kept:
the gate ran once for the iteration, as in a fixed plan. The job state machine is unchanged: a
window may span a change, since with state stored at every version (warm state is refused with a
schedule) the change needs nothing but the next iteration's Map items.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# the window's position and state, as every Pass between iterations keeps it (asl._carry), plus
# the gate's answer for the iteration about to run
_KEPT = ("job", "bucket", "t", "end", "window_start", "first", "attempt", "redo", "gate")
_REFS = ("StartAt", "Next", "Default")
# the window's lists of versions to evaluate and keep (asl._init_state), the same in every segment
_WINDOW_LISTS = ("evals", "saves", "sv")


def suffixed(name: str, j: int) -> str:
    """A state's name in segment ``j``'s graph."""
    return f"{name}_s{j}"


def _renamed(node: Any, j: int) -> Any:
    """``node`` (part of a definition) with every state name and reference given segment j's suffix."""
    if isinstance(node, list):
        return [_renamed(x, j) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _REFS and isinstance(value, str):
            out[key] = suffixed(value, j)
        elif key == "States" and isinstance(value, dict) and "StartAt" in node:
            out[key] = {suffixed(name, j): _renamed(state, j) for name, state in value.items()}
        elif key in ("Parameters", "ResultSelector", "ItemSelector"):
            out[key] = value  # payloads: no state names inside
        else:
            out[key] = _renamed(value, j)
    return out


def _dispatch(name: str, variable: str, firsts: Sequence[int], target: str) -> dict[str, Any]:
    """A Choice that sends ``variable`` (an iteration) to its segment's ``target`` state."""
    choices = [
        {"Variable": variable, "NumericGreaterThanEquals": first, "Next": suffixed(target, j)}
        for j, first in reversed(list(enumerate(firsts)))
    ]
    return {name: {"Type": "Choice", "Choices": choices[:-1], "Default": choices[-1]["Next"]}}


def _entry(init: dict[str, Any], j: int, mid_window: bool) -> dict[str, Any]:
    """Segment j's entry: its Init's Map items (its replicas and shards), the window's lists of
    versions to evaluate and keep as Init holds them (resume rewrites those there), the rest of
    the state as it is; mid-window (``Switch``) with the gate's answer, on to its Go?, else
    (``Enter``, an attempt's first iteration) on to its Gate."""
    params = init["Parameters"]
    literal = {k: v for k, v in params.items() if not k.endswith(".$") and k not in _WINDOW_LISTS and k != "redo"}
    kept = {f"{k}.$": f"$.{k}" for k in _KEPT if mid_window or k != "gate"}
    lists = {f"{k}.$": f"$.{k}" for k in _WINDOW_LISTS if k in params}
    return {"Type": "Pass", "Parameters": {**kept, **lists, **literal}, "Next": suffixed("Go?" if mid_window else "Gate", j)}


def _leave_segment(go: dict[str, Any], lo: int, hi: int | None) -> dict[str, Any]:
    """Segment's Go? with two more choices after Done and Stopped: an iteration outside [lo, hi)
    goes to Segment."""
    outside = [{"Variable": "$.t", "NumericLessThan": lo, "Next": "Segment"}]
    if hi is not None:
        outside.append({"Variable": "$.t", "NumericGreaterThanEquals": hi, "Next": "Segment"})
    return {**go, "Choices": [*go["Choices"], *outside]}


def joined_windows(parts: Sequence[tuple[int, dict[str, Any]]], comment: str) -> dict[str, Any]:
    """One definition of the segments' window definitions ``parts`` ((first iteration, definition),
    in order): StartAt picks the attempt's first iteration's segment; an iteration that leaves a
    segment enters the next through Segment and Switch_s{j}."""
    firsts = [first for first, _ in parts]
    init = parts[0][1]["States"]["Init"]
    states: dict[str, Any] = {"Init": {**init, "Next": "Start"}}  # the window's position and lists, as a fixed plan's
    for j, (first, definition) in enumerate(parts):
        renamed = _renamed(definition, j)["States"]
        del renamed[suffixed("Init", j)]  # entered through Enter_s{j}
        hi = firsts[j + 1] if j + 1 < len(firsts) else None
        renamed[suffixed("Go?", j)] = _leave_segment(renamed[suffixed("Go?", j)], first, hi)
        states.update(renamed)
        states[suffixed("Enter", j)] = _entry(definition["States"]["Init"], j, mid_window=False)
        states[suffixed("Switch", j)] = _entry(definition["States"]["Init"], j, mid_window=True)
    states.update(_dispatch("Start", "$.t", firsts, "Enter"))
    states.update(_dispatch("Segment", "$.t", firsts, "Switch"))
    return {"Comment": comment, "StartAt": "Init", "States": states}


def _route_on_gate(go: dict[str, Any], j: int, count: int) -> dict[str, Any]:
    """A policy window's Go? of choice j: after Done and Stopped, an iteration whose gate chose
    another choice's segment goes to Segment."""
    other = [{"Variable": "$.gate.segment", "NumericEquals": k, "Next": "Segment"} for k in range(count) if k != j]
    return {**go, "Choices": [*go["Choices"], *other]}


def policy_windows(parts: Sequence[tuple[int, dict[str, Any]]], comment: str) -> dict[str, Any]:
    """One definition of a replica policy's window graphs ``parts`` ((d, definition) per choice,
    in order): the window enters the largest choice's graph (its Map items serve any d), and every
    Gate answers ``segment``, the choice the policy made for the iteration's window (recorded by
    the gate, lambdas/gate.py); a Go? whose gate chose another segment goes to Segment, which
    enters that one's Go? through Switch_s{k} with the gate's answer kept (the gate ran once),
    as a schedule's change inside a window does: at most once per window, at its first iteration."""
    count = len(parts)
    init = parts[-1][1]["States"]["Init"]
    states: dict[str, Any] = {"Init": {**init, "Next": suffixed("Enter", count - 1)}}
    for j, (_, definition) in enumerate(parts):
        renamed = _renamed(definition, j)["States"]
        del renamed[suffixed("Init", j)]
        gate = renamed[suffixed("Gate", j)]
        gate["ResultSelector"] = {**gate["ResultSelector"], "segment.$": "$.Payload.segment"}
        renamed[suffixed("Go?", j)] = _route_on_gate(renamed[suffixed("Go?", j)], j, count)
        states.update(renamed)
        if j == count - 1:
            states[suffixed("Enter", j)] = _entry(definition["States"]["Init"], j, mid_window=False)
        states[suffixed("Switch", j)] = _entry(definition["States"]["Init"], j, mid_window=True)
    choices = [{"Variable": "$.gate.segment", "NumericEquals": k, "Next": suffixed("Switch", k)} for k in range(count)]
    states["Segment"] = {"Type": "Choice", "Choices": choices[:-1], "Default": choices[-1]["Next"]}
    return {"Comment": comment, "StartAt": "Init", "States": states}
