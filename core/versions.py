"""Which stored versions of a job's state are whole: where a resumed job or a restarted window starts.

A version v of the training state is the parameters after v iterations (every chunk of every
shard of every stage), the optimizer state at v (for a stateful optimizer; none exists at v = 0)
and the running statistics at v (where the model has them). Every complete version has the same
number of objects of each kind, so a version with as many as the most any version has is complete
and one still being written has fewer. Versions are deterministic functions of the seed and the
iteration (docs/reliability.md "Idempotence"), so training from any complete version ends
bit-identical to training through it.

Two readers: ``stagecoach resume`` (sdk/deploy/resume.py ``last_checkpoint``) and, after a window
attempt failed, the job state machine's ResumePoint step (lambdas/resumepoint.py), which restarts
the window from its latest complete version instead of its first iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

Counts = Mapping[int, int]  # version -> objects of one kind stored for it


def count_versions(keys_: Iterable[str], prefix: str) -> dict[int, int]:
    """How many keys under ``prefix`` (core/keys.py ``state_prefix``: ``.../v{version}/...``)
    each version has."""
    out: dict[int, int] = {}
    for key in keys_:
        v = int(key[len(prefix) :].split("/")[0][1:])
        out[v] = out.get(v, 0) + 1
    return out


def optimizer_keeps_state(make_optimizer: Callable[[list[nn.Parameter]], Any]) -> bool:
    """Whether the optimizer keeps per-parameter state (plain SGD does not: nothing to store).
    Written into the job's spec (JobSpec.optimizer_state), since a window's warm attempt stores the
    parameters of every version (d > 1) but the state only at its checkpoints: with no state stored
    yet, only the spec tells a version with parameters alone from a complete one."""
    p = nn.Parameter(torch.zeros(1))
    opt = make_optimizer([p])
    p.grad = torch.ones(1)
    opt.step()
    return bool(opt.state_dict()["state"])


def complete_versions(params: Counts, optim: Counts, buffers: Counts, stateful: bool | None = None) -> list[int]:
    """The versions whose every object is stored, in increasing order (see the module's docstring).
    ``stateful``: whether the optimizer keeps state (JobSpec.optimizer_state); None for a spec
    written before it was recorded: then whether any state is stored."""
    if not params:
        return []
    whole, statistics = max(params.values()), max(buffers.values(), default=0)
    stateful = bool(optim) if stateful is None else stateful
    return sorted(
        v for v, n in params.items() if n == whole and (v == 0 or not stateful or optim.get(v) == whole) and buffers.get(v, 0) == statistics
    )


def due_versions(evaluated: Iterable[int], every: int | None, iterations: int) -> set[int]:
    """The versions after whose iteration the window evaluates (``evaluated``: EvalSpec.versions)
    or keeps a loadable state_dict (every ``every`` iterations: Job.checkpoint_every)."""
    due = set(evaluated)
    if every:
        due |= set(range(every, iterations + 1, every))
    return due


def resume_point(complete: Iterable[int], start: int, end: int, unfinished: set[int]) -> int:
    """Where a window [start, end) restarts: its latest complete version in [start, end] whose
    evaluation or checkpoint, if one is due, was written (``unfinished``: the due versions whose
    records are missing — that work runs after the iteration reaching the version, so a restart
    there runs the iteration before it again). The window's first version is always there: the
    workers keep it until the window has finished."""
    inside = [v for v in complete if start <= v <= end and v not in unfinished]
    return max(inside, default=start)
