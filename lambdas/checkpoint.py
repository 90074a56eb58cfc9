"""The checkpoint phase: a loadable state_dict of the parameters after t iterations.

``Job(checkpoint_every=N)``: after every N-th iteration the window runs a Checkpoint Map, one task
per stage (its replica 0, on that replica's function, so a warm stage's state is at hand), which
writes the stage's parameters and buffers under the user's own names (the module's state_dict
keys) as ``checkpoints/v{t}/s{s}``, a safetensors file. The stages' files together are the model's
whole state_dict (``Run.checkpoint(t)`` merges them; ``Job(init_from=...)`` takes it), and they
stay after the run, unlike the iteration's objects. A weight tied across stages is written by
each stage that holds it, with the same values.
"""

from __future__ import annotations

from typing import Any

from stagecoach.core import keys
from stagecoach.core.events import CheckpointEvent
from stagecoach.core.graph_split import Segment
from stagecoach.lambdas.channel import Channel
from stagecoach.lambdas.jobctx import JobContext


def stage_state_dict(layers: Any, first: int) -> dict[str, Any]:
    """A stage's parameters and buffers under the whole model's state_dict names: a graph
    segment's by its pieces' own (the user's module names), an nn.Sequential block's as
    ``{index}.{name}``."""
    out: dict[str, Any] = {}
    for i, layer in enumerate(layers):
        if isinstance(layer, Segment):
            for piece in layer.pieces:
                for k, v in piece.state_dict().items():
                    out.setdefault(k, v)
        else:
            for k, v in layer.state_dict().items():
                out.setdefault(f"{first + i}.{k}", v)
    return out


def checkpoint(ctx: JobContext, ch: Channel, ev: CheckpointEvent, deadline: float) -> dict[str, Any]:
    s, v = ev.stage, ev.t
    warm = ctx.warm_attempt(ch, s, ev.window_start, ev.attempt)
    layers = ctx.ensure_params(ch, s, v, deadline, ev.window_start, warm)
    ctx.ensure_running_stats(ch, s, v)
    state = stage_state_dict(layers, ctx.plan.stage_layers(s).start)
    ch.put_tensors(keys.checkpoint(ctx.job, v, s), {k: t.detach().clone().contiguous() for k, t in state.items()})
    return {}
