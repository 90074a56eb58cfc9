"""Handwritten digits (scikit-learn's 8x8 digits, shipped with the package): a 6-block MLP with dropout.

    stagecoach train examples/digits.py          # 3 stages x 2 replicas on the embedded local stack

Every iteration runs as Step Functions states over Lambda tasks that exchange activations and
gradient shards through S3.
"""

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from stagecoach import Job
from stagecoach.evaluation import accuracy


def load() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """80/20 stratified split (1,437 / 360 images), features standardised on the training split."""
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    mean, scale = x_tr.mean(axis=0), x_tr.std(axis=0) + 1.0
    as_t = lambda a, b: (torch.tensor((a - mean) / scale, dtype=torch.float32), torch.tensor(b, dtype=torch.int64))  # noqa: E731
    return as_t(x_tr, y_tr), as_t(x_te, y_te)


def model() -> nn.Sequential:
    """Six blocks (dropout blocks included), so three stages hold two each."""
    return nn.Sequential(
        nn.Sequential(nn.Linear(64, 128), nn.ReLU()),
        nn.Dropout(0.1),
        nn.Sequential(nn.Linear(128, 128), nn.ReLU()),
        nn.Dropout(0.1),
        nn.Sequential(nn.Linear(128, 64), nn.ReLU()),
        nn.Linear(64, 10),
    )


def optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=3e-3)


train, test = load()

job = Job(
    name="digits",
    model=model,
    loss=nn.CrossEntropyLoss(),
    optimizer=optimizer,
    train=train,
    test=test,
    metrics={"accuracy": accuracy},  # evaluated on Lambda after the last iteration
    global_batch=64,
    iterations=100,
    seed=0,
    # windows as Express workflows where the model predicts them cheaper (this model's are: per
    # request and GB-second instead of per state transition; docs/runtime.md "Express windows")
    workflow="auto",
)

# the CLI's defaults for this file (override with --stages, --replicas, --micro-batches)
defaults = {"stages": 3, "replicas": 2, "micro_batches": 2, "memory_mb": 1024}
