"""The optimizer's hyperparameters at iteration t under the job's learning-rate scheduler.

``Job(scheduler=lambda optimizer: torch.optim.lr_scheduler.X(optimizer, ...))``, stepped once per
iteration after the optimizer, as a plain PyTorch loop does (``optimizer.step();
scheduler.step()``): iteration t trains with the parameter groups as they are after t scheduler
steps. Every task that updates parameters (a sync task, a backward task that updates alone or
exchanges shards) asks this for iteration t's groups and gives them to its shard's optimizer, so
all of them apply the same values, whatever the plan, however often a task is retried.

The scheduler runs here on a stand-in optimizer with the job's parameter groups (a one-element
parameter each): schedulers read and write only the groups' hyperparameters, never the
parameters. Any hyperparameter a scheduler moves counts, not only ``lr`` (OneCycleLR also cycles
momentum / betas). A container keeps its scheduler between tasks and steps it forward; a window
restart (t going back) rebuilds it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

MakeOptimizer = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
MakeScheduler = Callable[[torch.optim.Optimizer], Any]


def stand_in(make_optimizer: MakeOptimizer, groups: Sequence[dict[str, Any]] | None) -> torch.optim.Optimizer:
    """The user's optimizer over one-element parameters, with the job's groups (None: one group)."""
    opt = make_optimizer([torch.nn.Parameter(torch.zeros(1))])
    if groups:
        opt.param_groups = []
        for hp in groups:
            opt.add_param_group({**hp, "params": [torch.nn.Parameter(torch.zeros(1))]})
    return opt


def hyperparameters(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


class Schedule:
    def __init__(self, make_optimizer: MakeOptimizer, make_scheduler: MakeScheduler, groups: Sequence[dict[str, Any]] | None):
        self.make_optimizer, self.make_scheduler, self.groups = make_optimizer, make_scheduler, groups
        self._reset()

    def _reset(self) -> None:
        self.opt = stand_in(self.make_optimizer, self.groups)
        self.scheduler = self.make_scheduler(self.opt)
        self.t = 0

    def at(self, t: int) -> list[dict[str, Any]]:
        """The parameter groups' hyperparameters for iteration t (after t scheduler steps)."""
        if t < self.t:
            self._reset()
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": there is no step here
            warnings.simplefilter("ignore", UserWarning)
            while self.t < t:
                self.scheduler.step()
                self.t += 1
        return hyperparameters(self.opt)

    def lrs(self, t: int) -> list[float]:
        return [float(g["lr"]) for g in self.at(t)]
