"""A light task in the real worker's execution environment, reporting the process's own memory.

The module imports the worker's handler (torch, boto3, its init-phase warm-ups), so a local
zygote that imports this module holds what the real one holds. An invocation runs a small float64
stage forward and backward with an optimizer step, makes an S3 client as a task does, and runs a
full garbage collection (CPython runs one whenever its thresholds say so); then it reports the
process's memory from /proc/self/smaps_rollup: Rss, Pss and its unique (private) pages.
"""

import gc
import os
import time

import boto3
import torch
from torch import nn

import stagecoach.lambdas.handler  # noqa: F401  the real worker's imports and warm-up


def own_memory_mb() -> dict:
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) / 1024.0
    return {"rss": fields["Rss"], "pss": fields["Pss"], "uss": fields["Private_Clean"] + fields["Private_Dirty"]}


def handler(event, context):
    stage = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(torch.float64)
    optimizer = torch.optim.Adam(stage.parameters(), lr=0.01)
    loss = nn.functional.cross_entropy(stage(torch.ones(8, 16, dtype=torch.float64)), torch.zeros(8, dtype=torch.int64))
    loss.backward()
    optimizer.step()
    boto3.client("s3")
    gc.collect()
    time.sleep(event.get("hold_s", 0))  # the invocations overlap: each runs in a process of its own
    return {"pid": os.getpid(), **own_memory_mb()}
