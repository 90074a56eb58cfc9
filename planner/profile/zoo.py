"""The seed paper's models as nn.Sequential of blocks (buildable on the meta device).

Written from the architectures' descriptions (ResNet: He et al. 2016; AmoebaNet-D as GPipe/
torchgpipe configure it: genotype of Real et al. 2019 with TensorFlow's normal_concat; BERT-Large:
Devlin et al. 2019). A *block* (one child) is the unit the planner may cut between: a ResNet
bottleneck, an AmoebaNet cell, a Transformer encoder layer.

Sizes vs FuncPipe Table 1 (FuncPipe's "MB" is MiB, 2^20 bytes): see ``FUNCPIPE_TABLE1_MIB`` and
docs/planner.md. AmoebaNet cells pass (state, skip) tuples between blocks: the planner sizes them
and the runtime moves them across cuts (core/boundary.py; examples/amoebanet.py trains a small one).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from stagecoach.planner.profile.layers import ModelProfile
from stagecoach.planner.profile.meta import profile_meta

# FuncPipe Table 1: parameters MiB / activations per sample MiB
FUNCPIPE_TABLE1_MIB = {
    "resnet101": (170, 198),
    "amoebanet_d18": (476, 432),
    "amoebanet_d36": (900, 697),
    "bert_large": (1153, 263),
}


# -- ResNet-101 ------------------------------------------------------------------------------
class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 with a projection shortcut when the shape changes."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + (x if self.down is None else self.down(x)))


def resnet101(num_classes: int = 1000) -> nn.Sequential:
    """ResNet-101: stem, 33 bottlenecks (3, 4, 23, 3), head — 35 blocks."""
    blocks: OrderedDict[str, nn.Module] = OrderedDict()
    blocks["stem"] = nn.Sequential(
        nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
    )
    cin = 64
    for si, (n, width) in enumerate(zip((3, 4, 23, 3), (64, 128, 256, 512))):
        for i in range(n):
            blocks[f"layer{si + 1}_{i}"] = Bottleneck(cin, width, 2 if (i == 0 and si > 0) else 1)
            cin = width * 4
    blocks["head"] = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))
    return nn.Sequential(blocks)


# -- AmoebaNet-D -----------------------------------------------------------------------------
def _rcb(cin: int, cout: int, k: Any = 1, stride: Any = 1, pad: Any = 0) -> nn.Sequential:
    return nn.Sequential(nn.ReLU(), nn.Conv2d(cin, cout, k, stride, pad, bias=False), nn.BatchNorm2d(cout))


class _FactorizedReduce(nn.Module):
    """Halve the resolution with two offset strided 1x1 convolutions (no information dropped)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.a = nn.Conv2d(cin, cout // 2, 1, stride=2, bias=False)
        self.b = nn.Conv2d(cin, cout - cout // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(x)
        shifted = nn.functional.pad(x[:, :, 1:, 1:], (0, 1, 0, 1))
        return self.bn(torch.cat([self.a(x), self.b(shifted)], dim=1))


def _op(kind: str, c: int, stride: int) -> nn.Module:
    if kind == "none":
        return nn.Identity() if stride == 1 else _FactorizedReduce(c, c)
    if kind == "avg3":
        return nn.AvgPool2d(3, stride, 1, count_include_pad=False)
    if kind == "max3":
        return nn.MaxPool2d(3, stride, 1)
    if kind == "max2":
        return nn.MaxPool2d(2, stride)
    if kind == "conv1":
        return _rcb(c, c, 1, stride)
    if kind == "conv3":  # bottlenecked 3x3
        return nn.Sequential(_rcb(c, c // 4), _rcb(c // 4, c // 4, 3, stride, 1), _rcb(c // 4, c))
    if kind == "conv17_71":  # bottlenecked 1x7 then 7x1
        q = c // 4
        return nn.Sequential(_rcb(c, q), _rcb(q, q, (1, 7), (1, stride), (0, 3)), _rcb(q, q, (7, 1), (stride, 1), (3, 0)), _rcb(q, c))
    raise ValueError(kind)


# (input state index, operation) pairs; consecutive pairs are summed into a new state.
_NORMAL = [
    (1, "conv1"),
    (1, "max3"),
    (1, "none"),
    (0, "conv17_71"),
    (0, "conv1"),
    (0, "conv17_71"),
    (2, "max3"),
    (2, "none"),
    (1, "avg3"),
    (5, "conv1"),
]
_NORMAL_CONCAT = (0, 3, 4, 6)
_REDUCE = [
    (0, "max2"),
    (0, "max3"),
    (2, "none"),
    (1, "conv3"),
    (2, "conv17_71"),
    (2, "max3"),
    (3, "none"),
    (1, "max2"),
    (2, "avg3"),
    (3, "conv1"),
]
_REDUCE_CONCAT = (4, 5, 6)


class AmoebaCell(nn.Module):
    """One AmoebaNet-D cell: takes (prev, prev_prev) or a tensor, returns (out, prev)."""

    def __init__(self, c_pp: int, c_p: int, c: int, reduction: bool, reduction_prev: bool) -> None:
        super().__init__()
        self.pre1 = _rcb(c_p, c)
        if reduction_prev:
            self.pre0: nn.Module = _FactorizedReduce(c_pp, c)
        elif c_pp != c:
            self.pre0 = _rcb(c_pp, c)
        else:
            self.pre0 = nn.Identity()
        genome = _REDUCE if reduction else _NORMAL
        self.concat = _REDUCE_CONCAT if reduction else _NORMAL_CONCAT
        self.idx = [i for i, _ in genome]
        self.ops = nn.ModuleList(_op(k, c, 2 if (reduction and i < 2) else 1) for i, k in genome)
        self.out_channels = c * len(self.concat)

    def forward(self, x: Any) -> tuple[Tensor, Tensor]:
        s1, s0 = x if isinstance(x, tuple) else (x, x)
        skip = s1
        states = [self.pre1(s1), self.pre0(s0)]
        for j in range(0, len(self.ops), 2):
            states.append(self.ops[j](states[self.idx[j]]) + self.ops[j + 1](states[self.idx[j + 1]]))
        return torch.cat([states[i] for i in self.concat], dim=1), skip


class _AmoebaHead(nn.Module):
    def __init__(self, c: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: tuple[Tensor, Tensor]) -> Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x[0], 1), 1))


def amoebanet_d(num_normal: int = 18, num_filters: int = 256, num_classes: int = 1000) -> nn.Sequential:
    """AmoebaNet-D(num_normal, num_filters) as GPipe configures it: stem, two reduction cells,
    three groups of num_normal/3 normal cells separated by reduction cells, classifier."""
    if num_normal % 3:
        raise ValueError(f"num_normal={num_normal}: AmoebaNet-D has three equal groups, use a multiple of 3")
    c = num_filters // 4
    blocks: OrderedDict[str, nn.Module] = OrderedDict()
    blocks["stem"] = nn.Sequential(nn.ReLU(), nn.Conv2d(3, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c))
    c_pp = c_p = c
    red_prev = False

    def cell(reduction: bool) -> AmoebaCell:
        nonlocal c, c_pp, c_p, red_prev
        if reduction:
            c *= 2
        m = AmoebaCell(c_pp, c_p, c, reduction, red_prev)
        c_pp, c_p, red_prev = c_p, m.out_channels, reduction
        return m

    blocks["stem_red1"] = cell(True)
    blocks["stem_red2"] = cell(True)
    for g in range(3):
        if g:
            blocks[f"red{g}"] = cell(True)
        for i in range(num_normal // 3):
            blocks[f"normal{g + 1}_{i}"] = cell(False)
    blocks["head"] = _AmoebaHead(c_p, num_classes)
    return nn.Sequential(blocks)


# -- BERT-Large ------------------------------------------------------------------------------
class BertEmbeddings(nn.Module):
    def __init__(self, vocab: int, hidden: int, max_pos: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_pos, hidden)
        self.typ = nn.Embedding(2, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(0.1)

    def forward(self, ids: Tensor) -> Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.ln(self.tok(ids) + self.pos(pos)[None] + self.typ(torch.zeros_like(ids))))


class BertLayer(nn.Module):
    """Post-LN Transformer encoder layer (attention, then GELU feed-forward)."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden)
        self.ff1 = nn.Linear(hidden, ffn)
        self.ff2 = nn.Linear(ffn, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: Tensor) -> Tensor:
        b, n, h = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5, dim=-1)
        ctx = (self.drop(att) @ v).transpose(1, 2).reshape(b, n, h)
        x = self.ln1(x + self.drop(self.proj(ctx)))
        return self.ln2(x + self.drop(self.ff2(nn.functional.gelu(self.ff1(x)))))


class BertHead(nn.Module):
    def __init__(self, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.pool = nn.Linear(hidden, hidden)
        self.cls = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.cls(torch.tanh(self.pool(x[:, 0])))


def bert_large(num_classes: int = 2, vocab: int = 30522, max_pos: int = 512, layers: int = 24) -> nn.Sequential:
    """BERT-Large (24 x 1024, 16 heads, FFN 4096): embeddings, 24 encoder layers, pooler+classifier."""
    blocks: OrderedDict[str, nn.Module] = OrderedDict()
    blocks["embeddings"] = BertEmbeddings(vocab, 1024, max_pos)
    for i in range(layers):
        blocks[f"encoder{i}"] = BertLayer(1024, 16, 4096)
    blocks["head"] = BertHead(1024, num_classes)
    return nn.Sequential(blocks)


# -- registry --------------------------------------------------------------------------------
def _img() -> Tensor:
    return torch.randn(3, 224, 224)


def _ids(seq: int = 128) -> Tensor:
    return torch.zeros(seq, dtype=torch.long)


ZOO: dict[str, tuple[Callable[[], nn.Sequential], Callable[[], Tensor]]] = {
    "resnet101": (resnet101, _img),
    "amoebanet_d18": (lambda: amoebanet_d(18, 256), _img),
    "amoebanet_d36": (lambda: amoebanet_d(36, 256), _img),
    "bert_large": (bert_large, _ids),
}


def zoo_names() -> list[str]:
    return sorted(ZOO)


def zoo_model(name: str) -> tuple[Callable[[], nn.Sequential], Tensor]:
    """(model factory, one sample input) for a zoo name; build the factory under torch.device("meta")."""
    key = name.removeprefix("zoo:").lower().replace("-", "_")
    if key not in ZOO:
        raise KeyError(f"unknown zoo model {name!r}: choose one of {', '.join(zoo_names())}")
    factory, sample = ZOO[key]
    return factory, sample()


_PROFILE_CACHE: dict[str, Any] = {}


def _cache_path(key: str) -> Any:

    src = b"".join(Path(__file__).with_name(f).read_bytes() for f in ("zoo.py", "layers.py", "tensors.py", "meta.py"))
    tag = hashlib.sha256(src + torch.__version__.encode()).hexdigest()[:12]
    root = Path(os.environ.get("STAGECOACH_CACHE", Path.home() / ".cache" / "stagecoach"))
    return root / f"zoo-{key}-{tag}.json"


def zoo_profile(name: str, use_disk_cache: bool = True) -> Any:
    """Meta-device ModelProfile of a zoo model.

    FLOP counting on meta takes seconds per model, so profiles are cached per process and on disk
    (keyed by the source of the profile package's modules and the torch version; STAGECOACH_CACHE moves it).
    """

    key = name.removeprefix("zoo:").lower().replace("-", "_")
    if key in _PROFILE_CACHE:
        return _PROFILE_CACHE[key]
    factory, sample = zoo_model(key)
    path = _cache_path(key)
    if use_disk_cache and path.exists():
        prof = ModelProfile.from_dict(json.loads(path.read_text()))
    else:
        prof = profile_meta(factory, sample, name=key)
        if use_disk_cache:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(prof.to_dict()))
            except OSError:
                pass  # a read-only home: just recompute next time
    _PROFILE_CACHE[key] = prof
    return prof
