"""A small AmoebaNet-D (the zoo's cells, few filters) on scikit-learn's digits, upsampled to 3 x 32 x 32.

    stagecoach train examples/amoebanet.py       # 3 stages; (state, skip) pairs cross every cut
    stagecoach plan examples/amoebanet.py

AmoebaNet-D's cells take the two previous cells' outputs and return (this output, the previous
one): the pairs cross stage boundaries as tuples, each with its gradient (docs/exactness.md, "What
crosses a cut"). The model is stagecoach.planner.profile.zoo.amoebanet_d, the one the planner sizes
for FuncPipe's AmoebaNet-D(18/36, 256), here with 3 normal cells and 16 filters. Its BatchNorm keeps
the global batch together: one replica, one micro-batch.
"""

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from stagecoach import Job
from stagecoach.evaluation import accuracy
from stagecoach.planner.profile.zoo import amoebanet_d


def load() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """80/20 stratified split; 8x8 images scaled to [0, 1], upsampled to 32x32, three channels."""
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)

    def images(a):
        t = torch.tensor(a / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
        return nn.functional.interpolate(t, size=32, mode="bilinear", align_corners=False).expand(-1, 3, -1, -1).contiguous()

    return (images(x_tr), torch.tensor(y_tr)), (images(x_te), torch.tensor(y_te))


train, test = load()

job = Job(
    name="amoebanet",
    model=lambda: amoebanet_d(num_normal=3, num_filters=16, num_classes=10),
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
