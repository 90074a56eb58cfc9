"""Upload a job's data set as workers read it (core/samples.py): records in content-addressed
shards, then the manifest that names them. Each shard is hashed before it is sent and skipped if
the bucket holds exactly it, so the same data (or the part two data sets share) is uploaded once;
the manifest goes last, so its presence means every shard is there.

A name in the bucket is no proof of its bytes: whoever may write data/ could have put others under
it. So every object goes up with its SHA-256 (``ChecksumSHA256``), which S3 checks against the body
before it accepts the PUT and keeps with the object (S3 user guide, "Checking object integrity for
data uploads": https://docs.aws.amazon.com/AmazonS3/latest/userguide/checking-object-integrity-upload.html),
and an object already there is skipped only if HeadObject (``ChecksumMode=ENABLED``) returns that
same SHA-256: one HEAD per shard, as before, instead of downloading it. An object without it (put
by an older Stagecoach or by anything else) or with another is put again. Each object is one PUT
(shards are about 8 MiB; a multipart upload would carry a checksum of its parts' checksums instead).
Workers check what they read all the same (lambdas/datafetch.py): the bucket can change after an upload.
For that the manifest holds each record's digest (core/samples.py record_digest), taken here as the
record is encoded, so a worker reading a record by range checks it without the rest of its shard.
"""

from __future__ import annotations

import base64
import hashlib

import torch
from tqdm import tqdm

from stagecoach.core import keys
from stagecoach.core.samples import DIGEST_BYTES, SHARD_BYTES, LocalSamples, Manifest, encode, leaf_bytes, record_digest
from stagecoach.deploy.resources import BotoClient


def put_content_addressed(s3: BotoClient, bucket: str, key: str, body: bytes) -> bool:
    """Put ``body`` under its content-addressed ``key`` unless the bucket holds exactly these bytes
    there (by the SHA-256 S3 keeps with the object); True if it was put."""
    want = base64.b64encode(hashlib.sha256(body).digest()).decode()
    try:
        held = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED").get("ChecksumSHA256")
    except s3.exceptions.ClientError:  # absent (404), or 403 for a caller without s3:ListBucket
        held = None
    if held == want:
        return False
    s3.put_object(Bucket=bucket, Key=key, Body=body, ChecksumAlgorithm="SHA256", ChecksumSHA256=want)
    return True


def upload_samples(s3: BotoClient, bucket: str, samples: LocalSamples, progress: bool = False, what: str = "train") -> str:
    """Upload ``samples`` (unless the bucket holds them); returns the data set's id."""
    shards: list[str] = []
    first: list[int] = []
    offsets: list[int] = []
    base: list[int] = []
    in_bytes = tgt_bytes = 0
    body = bytearray()
    digests = bytearray()  # record_digest of every record, in order: input_0, target_0, input_1, ...
    local: list[int] = [0]
    n = len(samples)

    def flush() -> None:
        digest = hashlib.sha256(body).hexdigest()
        put_content_addressed(s3, bucket, keys.data_shard(digest), bytes(body))
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
                record = encode(part)
                body.extend(record)
                digests.extend(record_digest(record))
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
        torch.frombuffer(digests, dtype=torch.uint8).reshape(2 * n, DIGEST_BYTES).clone(),
        in_bytes,
        tgt_bytes,
    )
    ds_id = manifest.dataset_id()
    put_content_addressed(s3, bucket, keys.dataset(ds_id), manifest.body())
    return ds_id
