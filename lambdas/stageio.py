"""What a stage's worker receives and sends per micro-batch, and how it runs its blocks on it.

Two shapes of chain (docs/runtime.md "What crosses a cut"):

- ``ChainIO``: an nn.Sequential whose block i's output is block i+1's whole input (a tensor, or a
  tuple, list or dict of tensors: core/boundary.py). Stage s reads stage s-1's output and
  sends its own to stage s+1; gradients come back the same way.
- ``KeyedIO``: a model cut from its graph (core/graph_split.py) passes named values. Each goes
  from the stage that computes it straight to the stages that read it (one object per set of
  readers), and each reader sends its gradient straight back, where the producer sums the
  readers' gradients in stage order (planner/profile/flows.py). A skip connection from stage 0
  to stage 3 is then one upload and one download, not three of each.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from stagecoach.core import boundary, keys
from stagecoach.core.graph_split import Segment
from stagecoach.core.training import derive_seed, run_layers
from stagecoach.lambdas.channel import Channel
from stagecoach.planner.profile.flows import Route


def one_ahead(order: Sequence[int], fetch: Callable[[int], Callable[[], Any]]) -> Iterator[tuple[int, Any]]:
    """Micro-batches ``order`` and their inputs, each asked for (``fetch``: start the download,
    return the call that gives it) before the previous one is handed out: while the caller computes
    micro-batch j, j's successor downloads (or is waited for) in the background. One request
    ahead, two inputs held; a request latency leaves every step but the first
    (docs/performance-model.md §3.1, §3.2)."""
    pending = fetch(order[0]) if order else None
    for i, j in enumerate(order):
        assert pending is not None
        x = pending()
        pending = fetch(order[i + 1]) if i + 1 < len(order) else None
        yield j, x


class StageIO(ABC):
    """One stage's side of the pipeline hand-offs (activations forward, their gradients back)."""

    def __init__(self, job: str, stage: int, last: bool, space: str = ""):
        self.job, self.stage, self.last, self.space = job, stage, last, space  # space: keys.act

    def act_producer(self, t: int, stage: int, r: int) -> str | None:
        """The metrics key of the task that writes stage ``stage``'s activations of iteration t
        for replica r: its forward task (lambdas/phases.py forward; the last stage sends none). A
        consumer that finds them of its own window attempt but not the object knows the object is
        lost (lambdas/channel.py ObjectLost). None for the evaluation's hand-offs ("eval/")."""
        return keys.metrics(self.job, t, "forward", stage, r) if not self.space else None

    def grad_producer(self, t: int, stage: int, r: int) -> str:
        """The metrics key of the task that writes stage ``stage``'s input gradients of iteration t
        for replica r: its backward task (lambdas/phases.py _backward_passes)."""
        return keys.metrics(self.job, t, "backward", stage, r)

    def receive(self, ch: Channel, t: int, r: int, mb: int, deadline: float) -> Any:
        """The stage's input for micro-batch ``mb`` (stage > 0), as the earlier stages sent it."""
        return self.receive_later(ch, t, r, mb, deadline)()

    @abstractmethod
    def receive_later(self, ch: Channel, t: int, r: int, mb: int, deadline: float) -> Callable[[], Any]:
        """Start downloading the input of micro-batch ``mb`` (in the background, waiting for it if
        it is not there yet); the returned call gives the input once it is here."""

    @abstractmethod
    def run(self, layers: Iterable[nn.Module], first: int, x: Any, seed: int, t: int, r: int, mb: int) -> Any:
        """The stage's blocks on ``x`` (stage 0: its rows of the data set), each reseeded as
        training.run_layers does; the last stage returns the model's output."""

    @abstractmethod
    def send(self, ch: Channel, t: int, r: int, mb: int, y: Any) -> None:
        """Hand the output on to the stages that read it (in the background)."""

    @abstractmethod
    def output_grads(self, ch: Channel, t: int, r: int, mb: int, y: Any, deadline: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The output tensors that get a gradient, and those gradients (from the readers)."""

    @abstractmethod
    def send_input_grads(self, ch: Channel, t: int, r: int, mb: int, x: Any) -> None:
        """The gradients of the floating inputs, back to the stages that sent them."""

    @abstractmethod
    def written(self, t: int, r: int, mb: int) -> list[str]:
        """The hand-off objects this worker wrote for micro-batch ``mb`` of iteration t."""

    def sends_grads(self, x: Any) -> bool:
        return self.stage > 0 and boundary.floating(x)


class ChainIO(StageIO):
    """Block i's output is block i+1's whole input: stage s reads stage s-1's output."""

    def receive_later(self, ch: Channel, t: int, r: int, mb: int, deadline: float) -> Callable[[], Any]:
        key = keys.act(self.job, t, self.stage - 1, r, mb, space=self.space)
        pending = ch.submit_wait(key, deadline, self.act_producer(t, self.stage - 1, r))
        return lambda: boundary.unpack(pending.result())

    def run(self, layers: Iterable[nn.Module], first: int, x: Any, seed: int, t: int, r: int, mb: int) -> Any:
        return run_layers(layers, first, x, seed, t, r, mb)

    def send(self, ch: Channel, t: int, r: int, mb: int, y: Any) -> None:
        ch.submit_handoff(keys.act(self.job, t, self.stage, r, mb, space=self.space), boundary.pack(y))

    def output_grads(self, ch: Channel, t: int, r: int, mb: int, y: Any, deadline: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # an output without floating leaves gets no gradient from the next stage (it sends none)
        if not boundary.floating(y):
            return boundary.backward_pairs(y, {})
        g = ch.wait_tensors(keys.grad(self.job, t, self.stage + 1, r, mb), deadline, self.grad_producer(t, self.stage + 1, r))
        return boundary.backward_pairs(y, g)

    def send_input_grads(self, ch: Channel, t: int, r: int, mb: int, x: Any) -> None:
        ch.submit_handoff(keys.grad(self.job, t, self.stage, r, mb), boundary.grads_of(x))

    def written(self, t: int, r: int, mb: int) -> list[str]:
        return [keys.act(self.job, t, self.stage, r, mb), keys.grad(self.job, t, self.stage, r, mb)]


class KeyedIO(StageIO):
    """Named values, each sent by the stage computing it straight to the stages reading it."""

    def __init__(self, job: str, stage: int, last: bool, route: Route, space: str = ""):
        super().__init__(job, stage, last, space)
        self.route = route

    def receive_later(self, ch: Channel, t: int, r: int, mb: int, deadline: float) -> Callable[[], dict[str, torch.Tensor]]:
        pending = [
            ch.submit_wait(keys.act(self.job, t, tr.producer, r, mb, tr.name, self.space), deadline, self.act_producer(t, tr.producer, r))
            for tr in self.route.inputs
        ]

        def values() -> dict[str, torch.Tensor]:
            out: dict[str, torch.Tensor] = {}
            for tr, fut in zip(self.route.inputs, pending):
                got = fut.result()
                out.update((k, got[k]) for k in tr.keys)
            return out

        return values

    def run(self, layers: Iterable[nn.Module], first: int, x: Any, seed: int, t: int, r: int, mb: int) -> Any:
        segments = [seg for seg in layers if isinstance(seg, Segment)]
        assert len(segments) == len(list(layers)), "a keyed chain is made of graph segments (core/graph_split.py)"
        head = segments[0]
        values: dict[str, Any] = {head.takes[0]: x} if self.stage == 0 else {k: (int(v) if k in head.ints else v) for k, v in x.items()}
        for i, seg in enumerate(segments):
            torch.manual_seed(derive_seed(seed, t, first + i, r, mb))
            values.update(seg.step(values))
        if self.last:
            return segments[-1].output(values)
        return {k: torch.tensor(values[k]) if k in head.ints else values[k] for k in self.route.output_keys}

    def send(self, ch: Channel, t: int, r: int, mb: int, y: dict[str, torch.Tensor]) -> None:
        for tr in self.route.outputs:
            ch.submit_handoff(keys.act(self.job, t, self.stage, r, mb, tr.name, self.space), {k: y[k] for k in tr.keys})

    def output_grads(
        self, ch: Channel, t: int, r: int, mb: int, y: dict[str, torch.Tensor], deadline: float
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        senders = self.route.grad_senders()
        pending = [ch.submit_wait(keys.grad(self.job, t, c, r, mb, to=self.stage), deadline, self.grad_producer(t, c, r)) for c in senders]
        total: dict[str, torch.Tensor] = {}
        for fut in pending:  # summed in the readers' stage order, so every retry adds alike
            for k, g in fut.result().items():
                total[k] = total[k] + g if k in total else g
        outs = [k for k in self.route.output_keys if k in total and y[k].requires_grad]
        return [y[k] for k in outs], [total[k] for k in outs]

    def send_input_grads(self, ch: Channel, t: int, r: int, mb: int, x: dict[str, torch.Tensor]) -> None:
        for p in self.route.grad_receivers(self.stage):
            floating = [k for tr in self.route.inputs if tr.producer == p for k in tr.floating]
            grads = {k: _grad(x[k]) for k in floating}
            ch.submit_handoff(keys.grad(self.job, t, self.stage, r, mb, to=p), grads)

    def written(self, t: int, r: int, mb: int) -> list[str]:
        acts = [keys.act(self.job, t, self.stage, r, mb, tr.name) for tr in self.route.outputs]
        return acts + [keys.grad(self.job, t, self.stage, r, mb, to=p) for p in self.route.grad_receivers(self.stage)]


def _grad(x: torch.Tensor) -> torch.Tensor:
    """A leaf's gradient, zeros where none reached it."""
    return x.grad if x.grad is not None else torch.zeros_like(x)
