"""``python -m stagecoach.aws deployer-policy --stack NAME [--region R]``: the deployer policy
rendered for a deployed stack (its bucket, roles, region and account filled in)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import boto3
from botocore.exceptions import ClientError

from stagecoach.aws.access import explain_access_denied
from stagecoach.aws.policy import deployer_policy
from stagecoach.aws.stack import StackError, _arn_account, _arn_part, stack_outputs


def _main(argv: list[str] | None = None) -> int:
    """``python -m stagecoach.aws deployer-policy --stack NAME [--region R]``."""
    ap = argparse.ArgumentParser(prog="python -m stagecoach.aws")
    sub = ap.add_subparsers(dest="command", required=True)
    dp = sub.add_parser("deployer-policy", help="print the deployer policy rendered for a deployed stack")
    dp.add_argument("--stack", required=True)
    dp.add_argument("--region", default=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"))
    args = ap.parse_args(argv)
    try:
        region = args.region or boto3.Session().region_name
        if not region:
            raise StackError("no AWS region: pass --region, or set AWS_REGION")
        cfn = boto3.client("cloudformation", region_name=region)
        explain_access_denied(cfn, args.stack, region, "*")
        out = stack_outputs(cfn, args.stack, region)
    except (StackError, ClientError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    role = out["ControlRoleArn"]
    pol = deployer_policy(
        args.stack,
        region,
        _arn_account(role),
        _arn_part(role, 1) or "aws",
        out["BucketName"],
        boundary=out["JobRoleBoundaryArn"],
    )
    print(json.dumps(pol, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
