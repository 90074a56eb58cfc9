"""Values that cross cuts by name: where each is computed, where it is read, and so which stage
sends it to which (docs/runtime.md "Values that skip stages").

A model cut from its graph (core/graph_split.py) is a chain of blocks that pass named values:
the hidden state, a mask computed once at the start, a skip connection from an early block to a
late one. Relaying each value through every stage between its producer and its reader would
upload and download it at each of them; instead the stage that computes a value sends it straight
to the stages that read it, one object per set of readers, and each reader sends its gradient
straight back. What a stage receives is then only what it reads, and what it sends only what it
computed, so per stage the bytes are at most the relayed ones (the cut's live values).

Plain data, shared by the runtime (which routes by it) and the performance model (which counts
its bytes per candidate stage), so the two cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Flow:
    """One named value of a keyed chain."""

    key: str
    producer: int  # the block that computes it; -1 for the model's input (which stage 0 reads)
    users: tuple[int, ...]  # the blocks that read it; the last block too if it is part of the output
    floating: bool  # a floating value gets a gradient back; ids, masks and sizes do not
    bytes_per_sample: float = 0.0
    grad_bytes_per_sample: float = 0.0  # 0 unless floating

    def to_dict(self) -> dict[str, object]:
        return {
            "key": self.key,
            "producer": self.producer,
            "users": list(self.users),
            "floating": self.floating,
            "bytes_per_sample": self.bytes_per_sample,
            "grad_bytes_per_sample": self.grad_bytes_per_sample,
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Flow:
        users = d["users"]
        assert isinstance(users, list)
        return cls(
            key=str(d["key"]),
            producer=int(str(d["producer"])),
            users=tuple(int(u) for u in users),
            floating=bool(d["floating"]),
            bytes_per_sample=float(str(d.get("bytes_per_sample", 0.0))),
            grad_bytes_per_sample=float(str(d.get("grad_bytes_per_sample", 0.0))),
        )


@dataclass(frozen=True)
class Transfer:
    """One object per (stage, micro-batch): the values ``producer`` sends to exactly the stages
    ``consumers`` (each reads all of them), in production order."""

    producer: int
    consumers: tuple[int, ...]
    keys: tuple[str, ...]
    floating: tuple[str, ...]  # the keys that get a gradient back

    @property
    def name(self) -> str:
        """The object's name under the producer's key (core/keys.py act)."""
        return "to" + "-".join(str(c) for c in self.consumers)


@dataclass(frozen=True)
class Route:
    """What one stage receives (from each earlier stage) and sends (to later stages)."""

    inputs: tuple[Transfer, ...]
    outputs: tuple[Transfer, ...]

    @property
    def input_keys(self) -> tuple[str, ...]:
        return tuple(k for tr in self.inputs for k in tr.keys)

    @property
    def output_keys(self) -> tuple[str, ...]:
        return tuple(k for tr in self.outputs for k in tr.keys)

    def grad_senders(self) -> tuple[int, ...]:
        """The stages that send this stage gradients: readers of a floating value it sent."""
        return tuple(sorted({c for tr in self.outputs if tr.floating for c in tr.consumers}))

    def grad_receivers(self, stage: int) -> tuple[int, ...]:
        """The stages this one sends gradients to: producers of a floating value it read."""
        return tuple(sorted({tr.producer for tr in self.inputs if tr.floating and stage in tr.consumers}))


def _stage_of(ranges: Sequence[range]) -> dict[int, int]:
    return {b: s for s, rng in enumerate(ranges) for b in rng}


def routes(flows: Sequence[Flow], ranges: Sequence[range]) -> list[Route]:
    """Each stage's route for blocks cut into ``ranges`` (consecutive index ranges, one per stage)."""
    stage_of = _stage_of(ranges)
    sent: dict[tuple[int, tuple[int, ...]], list[Flow]] = {}
    for f in flows:
        p = stage_of[max(f.producer, 0)]
        readers = tuple(sorted({stage_of[u] for u in f.users} - {p}))
        if any(c < p for c in readers):
            raise ValueError(f"value {f.key!r} is read by a block before the one that computes it")
        if readers:
            sent.setdefault((p, readers), []).append(f)
    transfers = [Transfer(p, cs, tuple(f.key for f in fs), tuple(f.key for f in fs if f.floating)) for (p, cs), fs in sorted(sent.items())]
    return [
        Route(tuple(tr for tr in transfers if s in tr.consumers), tuple(tr for tr in transfers if tr.producer == s))
        for s in range(len(ranges))
    ]


@dataclass(frozen=True)
class StageBytes:
    """Bytes per sample one stage receives and sends (and their gradients), with direct sends."""

    in_ps: float
    out_ps: float
    ingrad_ps: float
    outgrad_ps: float


def stage_bytes(flows: Sequence[Flow], lo: int, hi: int) -> StageBytes:
    """What a stage holding blocks [lo, hi) receives: the values it reads that earlier blocks
    computed; and sends: the values it computes that later blocks read, once each (one object per
    set of readers). For lo = 0 the input is the data set's rows, which the caller counts."""
    inside = range(lo, hi)
    ins = [f for f in flows if max(f.producer, 0) < lo and any(u in inside for u in f.users)]
    outs = [f for f in flows if max(f.producer, 0) in inside and any(u >= hi for u in f.users)]
    return StageBytes(
        in_ps=sum(f.bytes_per_sample for f in ins),
        out_ps=sum(f.bytes_per_sample for f in outs),
        ingrad_ps=sum(f.grad_bytes_per_sample for f in ins),
        outgrad_ps=sum(f.grad_bytes_per_sample for f in outs),
    )


def merged_flows(flows: Sequence[Flow], sizes: Sequence[int]) -> tuple[Flow, ...]:
    """``flows`` with block indices mapped to the groups of ``sizes`` consecutive blocks (a merged
    profile, planner/profile/layers.py ModelProfile.merged); a value that stays inside one group
    no longer crosses any cut and is dropped."""
    group: dict[int, int] = {}
    i = 0
    for g, n in enumerate(sizes):
        for b in range(i, i + n):
            group[b] = g
        i += n
    out = []
    for f in flows:
        p = -1 if f.producer < 0 else group[f.producer]
        users = tuple(sorted({group[u] for u in f.users} - {max(p, 0)}))
        if users:
            out.append(Flow(f.key, p, users, f.floating, f.bytes_per_sample, f.grad_bytes_per_sample))
    return tuple(out)
