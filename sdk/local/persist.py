"""The local stack's state on disk, so that a daemon's jobs outlive a restart of its stack.

moto keeps everything in memory. Its server offers no snapshot of its state: its /moto-api/ has
reset, and a recorder that logs every request and replays the log (moto_api/_internal/recorder in
moto 5.2.1). A replay would run every execution and every worker's S3 write again (and lose the
CreateFunction calls the local access layer refuses right after CreateRole, as IAM does while a role
propagates), so it cannot restore a training job. Instead the stack's own process saves what the
jobs need through the public API (:class:`StackArchive`): every few seconds and when the stack stops,

- the resources: IAM's local managed policies and roles (with their inline policies), the buckets
  (with their default encryption), the Lambda functions (configuration, tags, reserved
  concurrency), the state machines (definition, role, tags);
- every bucket's objects, each written once per ETag (checkpoints, job specs, metrics), but for an
  iteration's transient ones (``TRANSIENT``), which a resumed run computes again;
- every execution: DescribeExecution and, once it has ended (or when the stack stops), its whole
  history (GetExecutionHistory).

When a stack starts with the same directory, it creates the resources again through the API, puts
the objects back, and hands the saved executions to moto's Step Functions backend as read-only
records, so ListExecutions, DescribeExecution and GetExecutionHistory answer as before: `stagecoach
list` and `inspect` find the jobs and `resume` continues them. An execution that was still running
when the stack went away cannot go on (its interpreter and workers are gone): it is restored as
ABORTED, with an ExecutionAborted event whose error is ``STOPPED_ERROR`` (its details: error and
cause, https://docs.aws.amazon.com/step-functions/latest/apireference/API_ExecutionAbortedEventDetails.html) — the status Step
Functions gives an execution that ended without succeeding or failing (StopExecution:
https://docs.aws.amazon.com/step-functions/latest/apireference/API_StopExecution.html). `resume`
continues such a job from its last complete checkpoint.

What is not kept: CloudWatch-style logs (the workers' log file stays in the daemon's log
directory) and the objects a crash (SIGKILL) left unsaved since the last periodic save.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import boto3
from botocore.config import Config

from stagecoach.deploy.resources import BotoClient, Clients
from stagecoach.deploy.roles import create_function_when_role_ready

ENV = "STAGECOACH_LOCAL_STATE"  # the directory; set by OwnedStack(state_dir=...) for the stack process
SAVE_EVERY_S = 10.0
STOPPED_ERROR = "Stagecoach.LocalStackStopped"
STOPPED_CAUSE = "the local stack stopped while this execution ran (its state was saved, its workers ended): resume the job"
ENDED = ("SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED")
_DATES = ("startDate", "stopDate", "timestamp")
# an iteration's objects (activations, gradients, sync shards, read copies: core/keys.py), recomputed
# by a resumed run from its checkpoint; not saved, which would double the stack's S3 traffic
TRANSIENT = re.compile(r"^jobs/[^/]+/(sync\d+/)?iter/")


def _name(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _write_json(path: str, value: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, default=lambda d: d.isoformat() if isinstance(d, datetime.datetime) else str(d))
    os.replace(tmp, path)


def _read_json(path: str, default: Any) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def _dates(record: dict[str, Any]) -> dict[str, Any]:
    """A saved record's dates as datetimes again (boto3 gives them so; moto serializes them)."""
    return {k: datetime.datetime.fromisoformat(v) if k in _DATES and isinstance(v, str) else v for k, v in record.items()}


class StackArchive:
    """Saves the stack at ``endpoint`` to ``directory`` and restores it from there."""

    def __init__(self, directory: str, endpoint: str) -> None:
        self.directory = directory
        for sub in ("objects", "executions"):
            os.makedirs(os.path.join(directory, sub), exist_ok=True)

        def client(service: str) -> BotoClient:
            return boto3.client(
                service,
                endpoint_url=endpoint,
                region_name="us-east-1",
                aws_access_key_id="local",  # the deployer's credentials: the access layer checks only the roles'
                aws_secret_access_key="local",
                config=Config(retries={"mode": "standard", "max_attempts": 5}),
            )

        self.c = Clients(s3=client("s3"), lambda_=client("lambda"), sfn=client("stepfunctions"), iam=client("iam"))
        self._lock = threading.Lock()
        self._ended: set[str] = set()  # executions whose final record is on disk

    # -- saving -----------------------------------------------------------------------------------

    def save(self) -> None:
        """Save the resources, the new objects and the executions (histories of ended ones)."""
        with self._lock:
            self._save_executions(final=False)
            self._save_resources_and_objects()

    def save_final(self, stop_workers: Callable[[], None]) -> None:
        """The save when the stack stops: the executions first, while they still run (saved as
        running, restored as ABORTED, not as the failures the workers' end would make of them);
        then ``stop_workers``, so that no worker writes while the objects are listed and read (a
        version's parameters live about an iteration: read while the job runs, a listed one may be
        gone by its GET); then the resources and objects."""
        with self._lock:
            self._save_executions(final=True)
            stop_workers()
            self._save_resources_and_objects()

    def _save_resources_and_objects(self) -> None:
        resources = {
            "policies": self._policies(),
            "roles": self._roles(),
            "buckets": self._buckets(),
            "functions": self._functions(),
            "state_machines": self._state_machines(),
        }
        for bucket in resources["buckets"]:
            self._save_objects(bucket["name"])
        _write_json(os.path.join(self.directory, "resources.json"), resources)

    def save_periodically(self, every_s: float = SAVE_EVERY_S) -> threading.Event:
        """Save every ``every_s`` seconds in a thread until the returned event is set."""
        done = threading.Event()

        def loop() -> None:
            while not done.wait(every_s):
                try:
                    self.save()
                except Exception as e:  # a save that failed is retried at the next one
                    print(f"stagecoach: saving the local stack failed: {e!r}", file=sys.stderr, flush=True)

        threading.Thread(target=loop, daemon=True, name="stagecoach-save").start()
        return done

    def _policies(self) -> list[dict[str, Any]]:
        out = []
        for page in self.c.iam.get_paginator("list_policies").paginate(Scope="Local"):
            for p in page["Policies"]:
                version = self.c.iam.get_policy_version(PolicyArn=p["Arn"], VersionId=p["DefaultVersionId"])["PolicyVersion"]
                out.append({"PolicyName": p["PolicyName"], "Path": p["Path"], "PolicyDocument": version["Document"]})
        return out

    def _roles(self) -> list[dict[str, Any]]:
        out = []
        for page in self.c.iam.get_paginator("list_roles").paginate():
            for r in page["Roles"]:
                name = r["RoleName"]
                role = self.c.iam.get_role(RoleName=name)["Role"]
                inline = {
                    p: self.c.iam.get_role_policy(RoleName=name, PolicyName=p)["PolicyDocument"]
                    for p in self.c.iam.list_role_policies(RoleName=name)["PolicyNames"]
                }
                attached = [a["PolicyArn"] for a in self.c.iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"]]
                create = {"RoleName": name, "Path": role["Path"], "AssumeRolePolicyDocument": role["AssumeRolePolicyDocument"]}
                if role.get("Description"):
                    create["Description"] = role["Description"]
                if role.get("PermissionsBoundary"):
                    create["PermissionsBoundary"] = role["PermissionsBoundary"]["PermissionsBoundaryArn"]
                out.append({"create": create, "inline": inline, "attached": attached})
        return out

    def _buckets(self) -> list[dict[str, Any]]:
        out = []
        for b in self.c.s3.list_buckets()["Buckets"]:
            try:
                rules = self.c.s3.get_bucket_encryption(Bucket=b["Name"])["ServerSideEncryptionConfiguration"]
            except self.c.s3.exceptions.ClientError:
                rules = None
            out.append({"name": b["Name"], "encryption": rules})
        return out

    def _functions(self) -> list[dict[str, Any]]:
        out = []
        for page in self.c.lambda_.get_paginator("list_functions").paginate():
            for f in page["Functions"]:
                got = self.c.lambda_.get_function(FunctionName=f["FunctionName"])
                cfg = got["Configuration"]
                create: dict[str, Any] = {
                    k: cfg[k] for k in ("FunctionName", "Role", "MemorySize", "Timeout", "PackageType", "Architectures") if k in cfg
                }
                create["Code"] = {"ImageUri": got["Code"]["ImageUri"]} if "ImageUri" in got.get("Code", {}) else {}
                if "ImageConfigResponse" in cfg:
                    create["ImageConfig"] = cfg["ImageConfigResponse"].get("ImageConfig", {})
                for k in ("Handler", "Runtime", "Description"):
                    if cfg.get(k):
                        create[k] = cfg[k]
                create["Environment"] = {"Variables": cfg.get("Environment", {}).get("Variables", {})}
                create["Tags"] = got.get("Tags", {})
                out.append({"create": create, "reserved": got.get("Concurrency", {}).get("ReservedConcurrentExecutions")})
        return out

    def _state_machines(self) -> list[dict[str, Any]]:
        out = []
        for page in self.c.sfn.get_paginator("list_state_machines").paginate():
            for sm in page["stateMachines"]:
                d = self.c.sfn.describe_state_machine(stateMachineArn=sm["stateMachineArn"])
                tags = self.c.sfn.list_tags_for_resource(resourceArn=sm["stateMachineArn"]).get("tags", [])
                out.append(
                    {
                        "stateMachineArn": sm["stateMachineArn"],
                        "create": {
                            "name": d["name"],
                            "definition": d["definition"],
                            "roleArn": d["roleArn"],
                            "type": d["type"],
                            "tags": tags,
                        },
                    }
                )
        return out

    def _save_objects(self, bucket: str) -> None:
        """Each object whose ETag is new (a rewritten key has a new one), and forget deleted ones."""
        folder = os.path.join(self.directory, "objects", _name(bucket))
        os.makedirs(folder, exist_ok=True)
        index_path = os.path.join(folder, "index.json")
        saved: dict[str, str] = _read_json(index_path, {})
        now: dict[str, str] = {}
        for page in self.c.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for o in page.get("Contents", []):
                key, etag = o["Key"], o["ETag"]
                if TRANSIENT.match(key):
                    continue
                if saved.get(key) != etag:
                    try:
                        body = self.c.s3.get_object(Bucket=bucket, Key=key)["Body"].read()
                    except self.c.s3.exceptions.NoSuchKey:
                        continue  # deleted since the listing
                    with open(os.path.join(folder, _name(key)), "wb") as f:
                        f.write(body)
                now[key] = etag
        for key in set(saved) - set(now):
            try:
                os.remove(os.path.join(folder, _name(key)))
            except OSError:
                pass
        _write_json(index_path, now)

    def _save_executions(self, final: bool) -> None:
        """Every execution not saved as ended yet; ``final``: with its history, and then never again."""
        machines = self.c.sfn.get_paginator("list_state_machines").paginate()
        # an EXPRESS machine's executions have no ListExecutions, describe or history (local/express.py)
        arns = [sm["stateMachineArn"] for page in machines for sm in page["stateMachines"] if sm.get("type") != "EXPRESS"]
        pages = (page for arn in arns for page in self.c.sfn.get_paginator("list_executions").paginate(stateMachineArn=arn))
        for page in pages:
            for e in page["executions"]:
                arn = e["executionArn"]
                if arn in self._ended:
                    continue
                ended = e["status"] in ENDED
                record = {k: v for k, v in self.c.sfn.describe_execution(executionArn=arn).items() if k != "ResponseMetadata"}
                history = None
                if ended or final:
                    pages = self.c.sfn.get_paginator("get_execution_history").paginate(executionArn=arn)
                    history = [event for p in pages for event in p["events"]]
                _write_json(os.path.join(self.directory, "executions", _name(arn) + ".json"), {"describe": record, "history": history})
                if ended or final:
                    self._ended.add(arn)

    # -- restoring --------------------------------------------------------------------------------

    def restore(self) -> bool:
        """Create the saved resources, objects and executions on this (new, empty) stack; False if
        nothing was saved here."""
        resources = _read_json(os.path.join(self.directory, "resources.json"), None)
        if resources is None:
            return False
        for p in resources["policies"]:
            self.c.iam.create_policy(**{**p, "PolicyDocument": json.dumps(p["PolicyDocument"])})
        for r in resources["roles"]:
            self.c.iam.create_role(**{**r["create"], "AssumeRolePolicyDocument": json.dumps(r["create"]["AssumeRolePolicyDocument"])})
            for name, doc in r["inline"].items():
                self.c.iam.put_role_policy(RoleName=r["create"]["RoleName"], PolicyName=name, PolicyDocument=json.dumps(doc))
            for arn in r["attached"]:
                self.c.iam.attach_role_policy(RoleName=r["create"]["RoleName"], PolicyArn=arn)
        for b in resources["buckets"]:
            self._restore_bucket(b)
        for f in resources["functions"]:
            create_function_when_role_ready(self.c, f["create"])
            if f["reserved"] is not None:
                self.c.lambda_.put_function_concurrency(
                    FunctionName=f["create"]["FunctionName"], ReservedConcurrentExecutions=f["reserved"]
                )
        for sm in resources["state_machines"]:
            self.c.sfn.create_state_machine(**sm["create"])
        self._restore_executions()
        return True

    def _restore_bucket(self, bucket: dict[str, Any]) -> None:
        name = bucket["name"]
        self.c.s3.create_bucket(Bucket=name)
        if bucket["encryption"]:
            self.c.s3.put_bucket_encryption(Bucket=name, ServerSideEncryptionConfiguration=bucket["encryption"])
        folder = os.path.join(self.directory, "objects", _name(name))
        index: dict[str, str] = _read_json(os.path.join(folder, "index.json"), {})
        kept: dict[str, str] = {}
        for key in index:
            try:
                with open(os.path.join(folder, _name(key)), "rb") as f:
                    body = f.read()
            except OSError:
                continue
            kept[key] = self.c.s3.put_object(Bucket=name, Key=key, Body=body)["ETag"]
        _write_json(os.path.join(folder, "index.json"), kept)  # the ETags this stack gives them

    def _restore_executions(self) -> None:
        """The saved executions as moto's records (an execution saved running: ABORTED), each
        rewritten to disk as restored so the next saves leave it be."""
        folder = os.path.join(self.directory, "executions")
        for file in sorted(os.listdir(folder)):
            if not file.endswith(".json"):
                continue
            saved = _read_json(os.path.join(folder, file), None)
            if saved is None:
                continue
            record, history = _dates(saved["describe"]), [_dates(e) for e in saved["history"] or []]
            if record["status"] not in ENDED:
                record, history = _aborted(record, history)
                _write_json(os.path.join(folder, file), {"describe": record, "history": history})
            _add_to_moto(ArchivedExecution(record, history))
            self._ended.add(record["executionArn"])


def _aborted(record: dict[str, Any], history: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An execution saved while it ran, as it ended: ABORTED when its stack stopped (the saved
    file's time), with an ExecutionAborted event closing its history."""
    when = max([e["timestamp"] for e in history] + [record["startDate"]])
    last = history[-1]["id"] if history else 0
    event = {
        "timestamp": when,
        "type": "ExecutionAborted",
        "id": last + 1,
        "previousEventId": last,
        "executionAbortedEventDetails": {"error": STOPPED_ERROR, "cause": STOPPED_CAUSE},
    }
    record = {**record, "status": "ABORTED", "stopDate": when, "error": STOPPED_ERROR, "cause": STOPPED_CAUSE}
    return record, [*history, event]


class ArchivedExecution:
    """A saved execution as moto's Step Functions backend reads one (the attributes its
    ListExecutions, DescribeExecution and GetExecutionHistory responses take from
    moto.stepfunctions.parser.backend.execution.Execution in moto 5.2.1): ended, read-only."""

    def __init__(self, record: dict[str, Any], history: list[dict[str, Any]]) -> None:
        self.name: str = record["name"]
        self.execution_arn: str = record["executionArn"]
        self.exec_arn = self.execution_arn
        self.state_machine_arn: str = record["stateMachineArn"]
        self.start_date: datetime.datetime = record["startDate"]
        self.stop_date: datetime.datetime | None = record.get("stopDate")
        self.status: str = record["status"]
        self.execution_input: str = record.get("input", "{}")
        self.output: str | None = record.get("output")
        self.output_details: dict[str, Any] | None = record.get("outputDetails")
        self.error: str | None = record.get("error")
        self.cause: str | None = record.get("cause")
        self.history = history

    def to_history_output(self) -> dict[str, Any]:
        return {"events": self.history}

    def get_execution_history(self, _role_arn: str) -> list[dict[str, Any]]:
        return self.history

    def stop(self, *_args: Any, **_kwargs: Any) -> None:
        """StopExecution of an ended execution changes nothing (as on AWS)."""


def _add_to_moto(execution: ArchivedExecution) -> None:
    """Append the record to its state machine's executions in this process's moto backend."""
    # moto is the `local` extra, heavy and optional: imported on use, in the stack process only
    from moto.stepfunctions.responses import get_backend

    _, _, _, region, account, *_ = execution.state_machine_arn.split(":")
    # moto's list of its Execution objects; a saved one answers the same attributes (duck-typed)
    executions: list[Any] = get_backend(account, region).describe_state_machine(execution.state_machine_arn).executions
    executions.append(execution)
