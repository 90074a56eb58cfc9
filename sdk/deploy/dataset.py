"""Upload a job's data set as workers read it (core/samples.py): records in content-addressed
shards, then the manifest that names them, all under the data set's own prefix ``data/<id>/``
(core/keys.py), its id the manifest's hash. Each shard is hashed before it is sent and skipped if
the bucket holds exactly it, so the same data is uploaded once and shared by the jobs that use it;
the manifest goes last, so its presence means every shard is there.

Why a prefix per data set rather than one pool of shards: a job's workers may read only the data
sets the job uses (issue 24; deploy/roles.py job_dataset_policy grants each set's prefix). A pool
would need every shard's key in the job's role policy, and IAM caps a role's inline policies at
10,240 characters in all (IAM user guide, "IAM and AWS STS quotas":
https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_iam-quotas.html), about a hundred
shard ARNs, under a gigabyte of data. The prefix needs the id before the first shard is sent, so
the set is encoded to local files first (``upload_samples``).

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
import tempfile
from pathlib import Path

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


def encode_samples(samples: LocalSamples, spool: Path, progress: bool = False, what: str = "train") -> tuple[Manifest, list[Path]]:
    """Walk ``samples`` once, writing the shards to files in the directory ``spool``; returns the
    manifest (and so the data set's id) and the shards' files, in the manifest's order."""
    shards: list[str] = []
    files: list[Path] = []
    first: list[int] = []
    offsets: list[int] = []
    base: list[int] = []
    in_bytes = tgt_bytes = 0
    body = bytearray()
    digests = bytearray()  # record_digest of every record, in order: input_0, target_0, input_1, ...
    local: list[int] = [0]
    n = len(samples)

    def flush() -> None:
        files.append(spool / str(len(shards)))
        files[-1].write_bytes(body)
        shards.append(hashlib.sha256(body).hexdigest())
        base.append(len(offsets))
        offsets.extend(local)
        body.clear()
        local[:] = [0]

    with tqdm(total=n, unit="sample", desc=f"encoding {what} set", disable=not progress, leave=False) as bar:
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
    return manifest, files


def upload_samples(s3: BotoClient, bucket: str, samples: LocalSamples, progress: bool = False, what: str = "train") -> str:
    """Upload ``samples`` (unless the bucket holds them) under their data set's own prefix; returns
    the data set's id. The id is the manifest's hash, known only once every record is encoded, so
    the shards are encoded to a temporary directory first (free disk for the encoded set, in
    Python's ``tempfile.gettempdir()``: TMPDIR), then sent."""
    with tempfile.TemporaryDirectory(prefix="stagecoach-data-") as spool:
        manifest, files = encode_samples(samples, Path(spool), progress, what)
        ds_id = manifest.dataset_id()
        total = sum(f.stat().st_size for f in files)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"uploading {what} set", disable=not progress, leave=False) as bar:
            for digest, file in zip(manifest.shards, files):
                body = file.read_bytes()
                put_content_addressed(s3, bucket, keys.data_shard(ds_id, digest), body)
                bar.update(len(body))
    put_content_addressed(s3, bucket, keys.dataset(ds_id), manifest.body())  # last: its presence means every shard is there
    return ds_id
