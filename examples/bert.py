"""A small BERT-style encoder, written as such models are written (not as an nn.Sequential), trained
to fill in a masked token: integer ids in, an attention mask over the padding, the output projection
tied to the word embeddings.

    stagecoach train examples/bert.py       # 3 stages, 2 replicas, 2 micro-batches
    stagecoach plan examples/bert.py

Stagecoach captures the model with torch.export and cuts it before the modules ``blocks`` names
(the embeddings, each encoder layer, the head; core/graph_split.py): the hidden states, the
boolean mask and the ids cross the cuts, the word embeddings live on the first stage and the head's
stage uses the same tensor (their gradients are summed before the update, docs/exactness.md).

The data is generated here: sequences that alternate two tokens (a b a b ...), 6 to 16 long and
padded, with one position replaced by [MASK]; the model must name the hidden token, which takes
both the other tokens and the masked position's parity.
"""

import math

import torch
from torch import nn

from stagecoach import Job
from stagecoach.evaluation import accuracy

PAD, MASK, VOCAB, LENGTH = 0, 1, 24, 16


class Embeddings(nn.Module):
    def __init__(self, vocab: int, length: int, dim: int) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.position = nn.Embedding(length, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.norm(self.word(ids) + self.position(positions))


class Layer(nn.Module):
    """Post-norm self-attention and feed-forward, as in BERT; padded keys get no attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, d = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)
        h = self.norm1(h + self.out(attended))
        return self.norm2(h + self.ff(h))


class Head(nn.Module):
    """BERT's masked-LM head: transform, then project onto the vocabulary with the word embeddings."""

    def __init__(self, word: nn.Embedding) -> None:
        super().__init__()
        dim = word.embedding_dim
        self.transform = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim))
        self.decoder = nn.Linear(dim, word.num_embeddings)
        self.decoder.weight = word.weight  # tied

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(h))


class Bert(nn.Module):
    def __init__(self, vocab: int = VOCAB, length: int = LENGTH, dim: int = 32, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.embeddings = Embeddings(vocab, length, dim)
        self.encoder = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.head = Head(self.embeddings.word)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = ids != PAD
        h = self.embeddings(ids)
        for layer in self.encoder:
            h = layer(h, mask)
        where = (ids == MASK).to(torch.int64).argmax(1)  # the one masked position of each sequence
        return self.head(h[torch.arange(ids.shape[0], device=ids.device), where])


def sequences(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n alternating sequences with one masked token each: (ids, the hidden token)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(2, VOCAB, (n,), generator=g)
    b = (a - 2 + torch.randint(1, VOCAB - 2, (n,), generator=g)) % (VOCAB - 2) + 2  # b != a
    lengths = torch.randint(6, LENGTH + 1, (n,), generator=g)
    pos = torch.arange(LENGTH)
    ids = torch.where(pos % 2 == 0, a[:, None], b[:, None])
    ids = torch.where(pos < lengths[:, None], ids, torch.full_like(ids, PAD))
    hidden = (torch.rand(n, generator=g) * lengths).long()
    labels = ids[torch.arange(n), hidden].clone()
    ids[torch.arange(n), hidden] = MASK
    return ids, labels


job = Job(
    name="bert",
    model=Bert,
    blocks=["embeddings", "encoder.*", "head"],
    loss=nn.CrossEntropyLoss(),
    optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01),
    train=sequences(4096, seed=1),
    test=sequences(512, seed=2),
    metrics={"accuracy": accuracy},  # evaluated on Lambda after the last iteration
    global_batch=64,
    iterations=100,
    seed=0,
)

defaults = {"stages": 3, "replicas": 2, "micro_batches": 2, "memory_mb": 1024}
