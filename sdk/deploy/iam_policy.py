"""IAM's evaluation of identity policies, for the parts Stagecoach's policies use.

The local stack enforces the stack's own roles with it (moto checks neither the Resource nor the
Condition of a statement), and the tests ask it what a policy grants. It follows IAM's policy
evaluation logic for one account: an explicit Deny wins; otherwise some identity policy must Allow,
and, when the role has a permissions boundary, the boundary must Allow too. Wildcards: ``*`` any run
of characters, ``?`` one, in actions (case-insensitive), resources and ``*Like`` conditions.

What it does not do, because no Stagecoach policy uses it: NotResource, policy variables,
``...IfExists`` operators, numeric and date operators, resource-based policies (the bucket policy's
TLS-only Deny has nothing to deny locally, where every call is plain HTTP on the loopback).
An operator it does not know raises: a policy it cannot evaluate never silently allows.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Context = Mapping[str, str | list[str]]


def arn_matches(pattern: str, value: str, ignore_case: bool = False) -> bool:
    """IAM's wildcard matching: ``*`` any run of characters (``/`` and ``:`` included), ``?`` one."""
    rx = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(rx, value, flags=re.DOTALL | (re.IGNORECASE if ignore_case else 0)) is not None


def _list(x: Any) -> list[Any]:
    return x if isinstance(x, list) else [x]


def _condition_holds(operator: str, key: str, expected: Any, context: Context) -> bool:
    present = context.get(key)
    if present is None:
        # a key absent from the request matches no positive operator (IAM: the condition is false)
        return operator.startswith("StringNot") or operator.startswith("ArnNot")
    values = _list(present)
    wanted = [str(e) for e in _list(expected)]
    if operator == "StringEquals":
        return any(v in wanted for v in values)
    if operator == "StringNotEquals":
        return all(v not in wanted for v in values)
    if operator in ("StringLike", "ArnLike", "ArnEquals"):
        return any(arn_matches(w, v) for v in values for w in wanted)
    if operator in ("StringNotLike", "ArnNotLike", "ArnNotEquals"):
        return not any(arn_matches(w, v) for v in values for w in wanted)
    if operator == "Bool":
        return any(v.lower() in [w.lower() for w in wanted] for v in values)
    raise ValueError(f"condition operator {operator!r} is not supported by the local evaluator (key {key})")


def statement_matches(st: Mapping[str, Any], action: str, resource: str, context: Context) -> bool:
    """Whether ``st`` applies to the request (its Effect aside)."""
    if "Action" in st:
        if not any(arn_matches(a, action, ignore_case=True) for a in _list(st["Action"])):
            return False
    elif any(arn_matches(a, action, ignore_case=True) for a in _list(st.get("NotAction", []))):
        return False
    if "NotResource" in st:
        raise ValueError("NotResource is not supported by the local evaluator")
    if not any(arn_matches(r, resource) for r in _list(st.get("Resource", []))):
        return False
    for operator, keys in (st.get("Condition") or {}).items():
        for key, expected in keys.items():
            if not _condition_holds(operator, key, expected, context):
                return False
    return True


@functools.lru_cache(maxsize=256)
def _parsed(document: str) -> Any:
    """A policy document's JSON, parsed once: the local stack decides every S3 GET a waiting worker makes."""
    return json.loads(document)


def _statements(policy: Mapping[str, Any] | str) -> list[Mapping[str, Any]]:
    doc = _parsed(policy) if isinstance(policy, str) else policy
    return _list(doc["Statement"])


def _allows(policies: Iterable[Mapping[str, Any] | str], action: str, resource: str, context: Context) -> bool:
    return any(st["Effect"] == "Allow" and statement_matches(st, action, resource, context) for p in policies for st in _statements(p))


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str  # AWS's phrase after "because", e.g. "no identity-based policy allows the s3:GetObject action"


def evaluate(
    action: str,
    resource: str,
    policies: Iterable[Mapping[str, Any] | str],
    boundary: Mapping[str, Any] | str | None = None,
    context: Context | None = None,
) -> Decision:
    """Decide one request of a principal whose identity policies are ``policies``."""
    ctx = context or {}
    policies = list(policies)
    for p in [*policies, *([boundary] if boundary is not None else [])]:
        for st in _statements(p):
            if st["Effect"] == "Deny" and statement_matches(st, action, resource, ctx):
                return Decision(False, f"an explicit deny in a policy denies the {action} action")
    if not _allows(policies, action, resource, ctx):
        return Decision(False, f"no identity-based policy allows the {action} action")
    if boundary is not None and not _allows([boundary], action, resource, ctx):
        return Decision(False, f"no permissions boundary allows the {action} action")
    return Decision(True, "allowed")
