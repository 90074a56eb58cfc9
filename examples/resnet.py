"""A small ResNet with BatchNorm on scikit-learn's 8x8 digits: a stem, three residual blocks, a head.

    stagecoach train examples/resnet.py          # 3 stages, the global batch kept together
    stagecoach plan examples/resnet.py           # plans that keep the batch together (BatchNorm)

The blocks are torchvision's BasicBlock in miniature (two 3x3 convolutions with BatchNorm, the
input added back). BatchNorm normalises over the batch, so only plans with one replica and one
micro-batch train exactly what plain PyTorch trains (docs/exactness.md): its running statistics are
updated by the forward pass alone and kept per stage; evaluation uses them.
"""

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from stagecoach import Job
from stagecoach.evaluation import accuracy


def load() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """80/20 stratified split, pixels scaled to [0, 1], as 1 x 8 x 8 images."""
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    as_t = lambda a, b: (torch.tensor(a / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8), torch.tensor(b, dtype=torch.int64))  # noqa: E731
    return as_t(x_tr, y_tr), as_t(x_te, y_te)


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN, plus the input, then ReLU (He et al., 2016)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)


def model() -> nn.Sequential:
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()),
        BasicBlock(16),
        BasicBlock(16),
        BasicBlock(16),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)),
    )


train, test = load()

job = Job(
    name="resnet",
    model=model,
    loss=nn.CrossEntropyLoss(),
    optimizer=lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9),
    train=train,
    test=test,
    metrics={"accuracy": accuracy},  # evaluated on Lambda after the last iteration
    global_batch=64,
    iterations=100,
    seed=0,
)

# BatchNorm: stages only (a split batch would normalise over its parts)
defaults = {"stages": 3, "replicas": 1, "micro_batches": 1, "memory_mb": 1024}
