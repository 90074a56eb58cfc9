"""Upload a job's data set as workers read it (core/samples.py): records in content-addressed
shards, then the manifest that names them. Each shard is hashed before it is sent and skipped if
the bucket has it, so the same data (or the part two data sets share) is uploaded once; the
manifest goes last, so its presence means every shard is there. Large shards go up in parts
(boto3's managed transfer: multipart above its threshold, parts in parallel)."""

from __future__ import annotations

import hashlib
import io

import torch
from boto3.s3.transfer import TransferConfig
from tqdm import tqdm

from stagecoach.core import keys
from stagecoach.core.samples import SHARD_BYTES, LocalSamples, Manifest, encode, leaf_bytes
from stagecoach.deploy.resources import BotoClient, object_exists

MULTIPART = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20, max_concurrency=4)


def upload_samples(s3: BotoClient, bucket: str, samples: LocalSamples, progress: bool = False, what: str = "train") -> str:
    """Upload ``samples`` (unless the bucket holds them); returns the data set's id."""
    shards: list[str] = []
    first: list[int] = []
    offsets: list[int] = []
    base: list[int] = []
    in_bytes = tgt_bytes = 0
    body = bytearray()
    local: list[int] = [0]
    n = len(samples)

    def flush() -> None:
        digest = hashlib.sha256(body).hexdigest()
        key = keys.data_shard(digest)
        if not object_exists(s3, bucket, key):
            s3.upload_fileobj(io.BytesIO(bytes(body)), bucket, key, Config=MULTIPART)
        shards.append(digest)
        base.append(len(offsets))
        offsets.extend(local)
        body.clear()
        local[:] = [0]

    with tqdm(total=n, unit="sample", desc=f"uploading {what} set", disable=not progress, leave=False) as bar:
        for i in range(n):
            if not body:
                first.append(i)
            inp, target = samples[i]
            in_bytes += leaf_bytes(inp)
            tgt_bytes += leaf_bytes(target)
            for part in (inp, target):
                body.extend(encode(part))
                local.append(len(body))
            if len(body) >= SHARD_BYTES:
                flush()
            bar.update(1)
        if body:
            flush()
    first.append(n)
    manifest = Manifest(
        tuple(shards),
        torch.tensor(first, dtype=torch.int64),
        torch.tensor(offsets, dtype=torch.int64),
        torch.tensor(base, dtype=torch.int64),
        in_bytes,
        tgt_bytes,
    )
    ds_id = manifest.dataset_id()
    if not object_exists(s3, bucket, keys.dataset(ds_id)):
        s3.put_object(Bucket=bucket, Key=keys.dataset(ds_id), Body=manifest.body())
    return ds_id
