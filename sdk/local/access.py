"""The local stack enforces the stack's own IAM roles on what its functions call, as AWS does.

On AWS a function calls S3 and Lambda with its execution role's credentials, and IAM decides each
call from the role's policies and permissions boundary. moto checks neither a statement's Resource
nor its Condition, so locally every call would succeed. Here each local function gets credentials
that name its role (:func:`credentials_for`), and a WSGI layer in front of moto decides every call
made with them by the role's policies as moto's IAM holds them (stagecoach.deploy.iam_policy),
answering a denial in the service's own shape (S3: 403 AccessDenied; Lambda: 403
AccessDeniedException), with AWS's message ("... is not authorized to perform: <action> on resource:
<arn> because no identity-based policy allows the <action> action").

Calls with any other credentials (the SDK's, the Step Functions interpreter's) pass unchecked: those
are the deployer's, whose policy the AWS tests check with moto. A call a role makes that this layer
cannot map to an IAM action and resource is denied, never waved through: the gap shows in a test
instead of on AWS.

Also here, for every caller: Lambda refuses a role IAM has not yet propagated (CreateFunction right
after CreateRole: "The role defined for the function cannot be assumed by Lambda."), for
``role_propagation_s``; and S3 refuses a PUT whose x-amz-checksum-sha256 is not its body's (400
BadDigest), which moto would store as given (see :func:`_bad_digest`).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import io
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict
from urllib.parse import parse_qs, unquote
from xml.etree import ElementTree

from stagecoach.deploy.iam_policy import Decision, evaluate

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

ACCOUNT = "123456789012"
REGION = "us-east-1"
_SECRET = "local-role-secret"


@dataclass(frozen=True)
class Session:
    role_arn: str
    session_name: str  # the function's name, as Lambda names the role session

    @property
    def principal(self) -> str:
        return f"arn:aws:sts::{ACCOUNT}:assumed-role/{self.role_arn.rsplit('/', 1)[-1]}/{self.session_name}"


_sessions: dict[str, Session] = {}
_lock = threading.Lock()


def credentials_for(role_arn: str, function_name: str) -> dict[str, str]:
    """A function's environment credentials: an access key id that names its role session here."""
    key = "ASIA" + hashlib.sha256(f"{role_arn}|{function_name}".encode()).hexdigest()[:16].upper()
    with _lock:
        _sessions[key] = Session(role_arn, function_name)
    return {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": _SECRET, "AWS_SESSION_TOKEN": f"local-session-{key}"}


@dataclass(frozen=True)
class Request:
    """One API call as IAM sees it: the actions it needs, each on a resource, with condition keys."""

    service: str
    checks: list[tuple[str, str, dict[str, Any]]]  # (action, resource ARN, context)


_CREDENTIAL = re.compile(r"Credential=([^/]+)/[^/]+/([^/]+)/([^/]+)/")


def _s3_request(method: str, path: str, query: dict[str, list[str]], environ: WSGIEnvironment, body: Callable[[], bytes]) -> Request:
    host = environ.get("HTTP_HOST", "").rsplit(":", 1)[0]
    if re.fullmatch(r"[0-9.]+|localhost", host):  # path style: /bucket/key (boto3's choice for an IP endpoint)
        bucket, _, key = unquote(path).lstrip("/").partition("/")
    else:  # virtual-hosted style: bucket.host/key
        bucket, key = host.split(".", 1)[0], unquote(path).lstrip("/")
    b = f"arn:aws:s3:::{bucket}"
    if not key:
        if method in ("GET", "HEAD") and not (
            set(query)
            - {"list-type", "prefix", "delimiter", "continuation-token", "max-keys", "start-after", "encoding-type", "fetch-owner"}
        ):
            return Request("s3", [("s3:ListBucket", b, {"s3:prefix": query.get("prefix", [""])[0]})])
        if method == "POST" and "delete" in query:
            root = ElementTree.fromstring(body())
            keys = [e.text or "" for e in root.iter() if e.tag.endswith("Key")]
            return Request("s3", [("s3:DeleteObject", f"{b}/{k}", {}) for k in keys])
        return Request("s3", [(f"s3:?{method}-bucket?{'&'.join(sorted(query))}", b, {})])
    obj = f"{b}/{key}"
    if "tagging" in query:
        action = {"GET": "s3:GetObjectTagging", "PUT": "s3:PutObjectTagging", "DELETE": "s3:DeleteObjectTagging"}.get(method, "s3:?")
        return Request("s3", [(action, obj, {})])
    if "uploadId" in query and method in ("GET", "DELETE"):
        # ListParts and AbortMultipartUpload have actions of their own (S3 user guide, "Multipart
        # upload API and permissions"): s3:PutObject does not grant aborting an upload
        action = "s3:ListMultipartUploadParts" if method == "GET" else "s3:AbortMultipartUpload"
        return Request("s3", [(action, obj, {})])
    if method in ("GET", "HEAD"):
        # a specific version is s3:GetObjectVersion, and s3:GetObject does not grant it (GetObject's
        # API reference, "versionId")
        return Request("s3", [("s3:GetObjectVersion" if "versionId" in query else "s3:GetObject", obj, {})])
    if method in ("PUT", "POST"):  # PutObject, the parts of a multipart upload, and the copies
        checks: list[tuple[str, str, dict[str, Any]]] = [("s3:PutObject", obj, {})]
        if environ.get("HTTP_X_AMZ_TAGGING"):
            checks.append(("s3:PutObjectTagging", obj, {}))
        return Request("s3", checks + _copy_source_checks(environ))
    if method == "DELETE":
        return Request("s3", [("s3:DeleteObjectVersion" if "versionId" in query else "s3:DeleteObject", obj, {})])
    return Request("s3", [(f"s3:?{method}", obj, {})])


def _copy_source_checks(environ: WSGIEnvironment) -> list[tuple[str, str, dict[str, Any]]]:
    """What a request with a source (x-amz-copy-source: CopyObject, UploadPartCopy) needs on it.

    S3 reads the source for the caller, so it checks s3:GetObject on the source object besides
    s3:PutObject on the destination (S3 API reference, CopyObject and UploadPartCopy,
    "Permissions": https://docs.aws.amazon.com/AmazonS3/latest/API/API_CopyObject.html,
    https://docs.aws.amazon.com/AmazonS3/latest/API/API_UploadPartCopy.html); a source
    "?versionId=" is a specific version, s3:GetObjectVersion. The header is "bucket/key" or
    "/bucket/key", the key URL-encoded. An access point or Outposts ARN as the source is not modelled
    here, so it is denied rather than waved through.
    """
    source = environ.get("HTTP_X_AMZ_COPY_SOURCE")
    if source is None:
        return []
    path, _, version = source.partition("?")  # the key's own "?" arrives encoded (%3F)
    path = unquote(path).lstrip("/")
    action = "s3:GetObjectVersion" if "versionId" in parse_qs(version) else "s3:GetObject"
    bucket, _, key = path.partition("/")
    if path.startswith("arn:") or not bucket or not key:
        return [("s3:?copy-source", path, {})]
    return [(action, f"arn:aws:s3:::{bucket}/{key}", {})]


_LAMBDA_ROUTES: list[tuple[str, str, str]] = [
    ("POST", r"/2015-03-31/functions/(?P<fn>[^/]+)/invocations", "lambda:InvokeFunction"),
    ("GET", r"/2015-03-31/functions/(?P<fn>[^/]+)/configuration", "lambda:GetFunctionConfiguration"),
    ("PUT", r"/2015-03-31/functions/(?P<fn>[^/]+)/configuration", "lambda:UpdateFunctionConfiguration"),
    ("PUT", r"/2015-03-31/functions/(?P<fn>[^/]+)/code", "lambda:UpdateFunctionCode"),
    ("GET", r"/2015-03-31/functions/(?P<fn>[^/]+)", "lambda:GetFunction"),
    ("DELETE", r"/2015-03-31/functions/(?P<fn>[^/]+)", "lambda:DeleteFunction"),
    ("PUT", r"/2017-10-31/functions/(?P<fn>[^/]+)/concurrency", "lambda:PutFunctionConcurrency"),
    ("GET", r"/2017-03-31/tags/(?P<fn>.+)", "lambda:ListTags"),
    ("POST", r"/2017-03-31/tags/(?P<fn>.+)", "lambda:TagResource"),
]


def _function_arn(name_or_arn: str) -> str:
    if name_or_arn.startswith("arn:"):
        return ":".join(name_or_arn.split(":")[:7])  # without a version or alias qualifier
    return f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{name_or_arn.split(':')[0]}"


def _lambda_request(method: str, path: str, tags_of: Callable[[str], dict[str, str]]) -> Request:
    for m, rx, action in _LAMBDA_ROUTES:
        found = re.fullmatch(rx, unquote(path))
        if m == method and found:
            arn = _function_arn(found["fn"])
            context = {f"aws:ResourceTag/{k}": v for k, v in tags_of(arn).items()}
            return Request("lambda", [(action, arn, context)])
    return Request("lambda", [(f"lambda:?{method} {path}", "*", {})])


def _json_request(service: str, environ: WSGIEnvironment, body: Callable[[], bytes]) -> Request:
    """JSON-protocol services (Step Functions, CloudWatch Logs, ...): the action from X-Amz-Target.
    A CloudWatch Logs call naming a log group is decided on the group's ARN in the form IAM policies
    use, with the trailing ":*" (CloudWatch Logs API reference, LogGroup.arn); any other resource is
    not modelled, so only a statement for every resource could allow it."""
    action = f"{service}:{environ.get('HTTP_X_AMZ_TARGET', '').rsplit('.', 1)[-1]}"
    if service == "logs":
        try:
            group = json.loads(body() or b"{}").get("logGroupName")
        except ValueError:
            group = None
        if isinstance(group, str) and group:
            return Request(service, [(action, f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:{group}:*", {})])
    return Request(service, [(action, "*", {})])


class AccessControl:
    """WSGI middleware: decides every call made with a local function's credentials."""

    def __init__(
        self,
        app: WSGIApplication,
        policies_of: Callable[[str], tuple[list[str], str | None]],
        tags_of: Callable[[str], dict[str, str]],
        role_age_s: Callable[[str], float | None],
        enforce: bool = True,
        role_propagation_s: float = 0.0,
    ) -> None:
        """``policies_of(role_arn)``: its identity policies and permissions boundary (JSON);
        ``tags_of(function_arn)``: a function's tags; ``role_age_s(role_arn)``: seconds since it was
        created (None if it does not exist)."""
        self.app = app
        self.policies_of = policies_of
        self.tags_of = tags_of
        self.role_age_s = role_age_s
        self.enforce = enforce
        self.role_propagation_s = role_propagation_s
        self.denials: list[str] = []

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        found = _CREDENTIAL.search(environ.get("HTTP_AUTHORIZATION", ""))
        body_cache: list[bytes] = []

        def body() -> bytes:
            if not body_cache:
                n = int(environ.get("CONTENT_LENGTH") or 0)
                data = environ["wsgi.input"].read(n) if n else b""
                environ["wsgi.input"] = io.BytesIO(data)
                body_cache.append(data)
            return body_cache[0]

        service = found.group(3) if found else ""
        method, path = environ.get("REQUEST_METHOD", "GET"), environ.get("PATH_INFO", "/")
        if service == "s3" and REQUEST_LOG_ENV in os.environ:
            start_response = _logged(environ, start_response, os.environ[REQUEST_LOG_ENV])
        if service == "lambda" and method == "POST" and re.fullmatch(r"/2015-03-31/functions/?", path) and self.role_propagation_s > 0:
            refused = self._unpropagated_role(body())
            if refused:
                return self._error(start_response, "lambda", 400, "InvalidParameterValueException", refused, method)
        if service == "s3" and method == "PUT":
            refused = _bad_digest(environ, body)
            if refused:
                return self._error(start_response, "s3", 400, "BadDigest", refused, method)
        session = _sessions.get(found.group(1)) if found else None
        if session is None or not self.enforce:
            return self.app(environ, start_response)
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        if service == "s3":
            request = _s3_request(method, path, query, environ, body)
        elif service == "lambda":
            request = _lambda_request(method, path, self.tags_of)
        else:
            request = _json_request(service, environ, body)
        policies, boundary = self.policies_of(session.role_arn)
        for action, resource, context in request.checks:
            decision = self._decide(action, resource, context, policies, boundary)
            if not decision.allowed:
                # S3 quotes the resource in its message, Lambda does not
                shown = f'"{resource}"' if request.service == "s3" else resource
                message = f"User: {session.principal} is not authorized to perform: {action} on resource: {shown} because {decision.reason}"
                self.denials.append(message)
                code = "AccessDenied" if request.service == "s3" else "AccessDeniedException"
                return self._error(
                    start_response, request.service, 403 if request.service in ("s3", "lambda") else 400, code, message, method
                )
        return self.app(environ, start_response)

    @staticmethod
    def _decide(action: str, resource: str, context: dict[str, Any], policies: list[str], boundary: str | None) -> Decision:
        if "?" in action.split(":", 1)[1]:
            return Decision(False, f"the local stack cannot tell which IAM action {action!r} is (stagecoach.local.access)")
        return evaluate(action, resource, policies, boundary, context)

    def _unpropagated_role(self, body: bytes) -> str | None:
        try:
            role = json.loads(body or b"{}").get("Role", "")
        except ValueError:
            return None
        age = self.role_age_s(role) if role else None
        if age is not None and age < self.role_propagation_s:
            return "The role defined for the function cannot be assumed by Lambda."
        return None

    @staticmethod
    def _error(start_response: StartResponse, service: str, status: int, code: str, message: str, method: str) -> list[bytes]:
        request_id = str(uuid.uuid4())
        reason = {400: "Bad Request", 403: "Forbidden"}[status]
        if service == "s3":
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{_xml(message)}</Message>'
                f"<RequestId>{request_id}</RequestId></Error>"
            ).encode()
            headers = [("Content-Type", "application/xml"), ("x-amz-request-id", request_id)]
        elif service == "lambda":  # rest-json: the error type in a header, the message in the body
            body = json.dumps({"Type": "User", "Message": message}).encode()
            headers = [("Content-Type", "application/json"), ("x-amzn-ErrorType", code), ("x-amzn-RequestId", request_id)]
        else:
            body = json.dumps({"__type": code, "message": message}).encode()
            headers = [("Content-Type", "application/x-amz-json-1.0"), ("x-amzn-RequestId", request_id)]
        if method == "HEAD":
            body = b""
        start_response(f"{status} {reason}", [*headers, ("Content-Length", str(len(body)))])
        return [body]


# A file every S3 request the stack serves is appended to, one line each ("METHOD\tkey\tquery\tstatus"),
# when the stack starts with this variable set: tests and benchmarks count requests by key
# (tests/test_requests.py, benchmarks/requests.py), from what S3 would bill, whoever makes them.
REQUEST_LOG_ENV = "STAGECOACH_S3_REQUEST_LOG"
_log_lock = threading.Lock()


def _logged(environ: WSGIEnvironment, start_response: StartResponse, path: str) -> StartResponse:
    """``start_response`` that also appends the request and its status to the request log."""
    line = "\t".join((environ.get("REQUEST_METHOD", ""), unquote(environ.get("PATH_INFO", "")), environ.get("QUERY_STRING", "")))

    def respond(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        with _log_lock, open(path, "a") as f:
            f.write(f"{line}\t{status.split()[0]}\n")
        return start_response(status, headers, exc_info)

    return respond


def _bad_digest(environ: WSGIEnvironment, body: Callable[[], bytes]) -> str | None:
    """S3's answer to a PUT whose SHA-256 checksum header is not its body's, or None.

    S3 computes the checksum of what it receives and refuses the PUT when it differs from the one
    given (S3 user guide, "Checking object integrity for data uploads":
    https://docs.aws.amazon.com/AmazonS3/latest/userguide/checking-object-integrity-upload.html);
    moto stores the given value unchecked, and the SDK's data upload trusts the stored one
    (deploy/dataset.py). A checksum in an aws-chunked trailer is not read here.
    """
    given = environ.get("HTTP_X_AMZ_CHECKSUM_SHA256")
    if not given or environ.get("HTTP_X_AMZ_CONTENT_SHA256", "").startswith("STREAMING-"):
        return None
    if base64.b64encode(hashlib.sha256(body()).digest()).decode() == given:
        return None
    return "The SHA256 you specified did not match the calculated checksum."


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class Lookups(TypedDict):
    """What :class:`AccessControl` reads of the stack's IAM and Lambda state (its keyword arguments)."""

    policies_of: Callable[[str], tuple[list[str], str | None]]
    tags_of: Callable[[str], dict[str, str]]
    role_age_s: Callable[[str], float | None]


def moto_lookups(account: str = ACCOUNT) -> Lookups:
    """The role policies, function tags and role ages as moto (in this process) holds them."""
    # moto is the `local` extra, heavy and optional: imported on use, in the stack process only
    from moto.awslambda.models import lambda_backends
    from moto.iam.models import IAMBackend, iam_backends

    def iam() -> IAMBackend:
        return iam_backends[account]["aws"]

    def policies_of(role_arn: str) -> tuple[list[str], str | None]:
        try:
            role = iam().get_role_by_arn(role_arn)
        except Exception:
            return [], None  # a role that does not exist grants nothing
        docs = [*role.policies.values()]
        for p in role.managed_policies.values():
            docs.extend(v.document for v in p.versions if v.is_default)
        boundary = None
        if role.permissions_boundary_arn:
            bp = iam().get_policy(role.permissions_boundary_arn)
            boundary = next(v.document for v in bp.versions if v.is_default)
        return docs, boundary

    def tags_of(function_arn: str) -> dict[str, str]:
        try:
            return dict(lambda_backends[account][REGION].get_function(function_arn).tags or {})
        except Exception:
            return {}

    def role_age_s(role_arn: str) -> float | None:
        try:
            created = iam().get_role_by_arn(role_arn).create_date
        except Exception:
            return None
        if created.tzinfo is None:  # moto keeps naive UTC
            created = created.replace(tzinfo=datetime.UTC)
        return time.time() - created.timestamp()

    return {"policies_of": policies_of, "tags_of": tags_of, "role_age_s": role_age_s}
