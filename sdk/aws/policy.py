"""The least-privilege deployer policy (docs/deployer-policy.json is rendered from it)."""

from __future__ import annotations

from typing import Any

from stagecoach.deploy.roles import STACK_TAG

Statement = dict[str, Any]  # one IAM policy statement, as JSON


# ----------------------------------------------------------------------------- deployer policy
def deployer_policy(
    stack: str = "${StackName}",
    region: str = "${Region}",
    account: str = "${AccountId}",
    partition: str = "aws",
    bucket: str = "${BucketName}",
    boundary: str | None = None,
) -> dict[str, Any]:
    """The least-privilege policy of the identity running the SDK against one stack.

    Everything is scoped to the stack: its bucket (by name: CloudFormation generates it, so the
    placeholder is filled from the stack's BucketName output), its roles, and the names the SDK
    gives per-job resources ("<stack>-*", the naming contract of sdk/deploy/). The placeholders
    render docs/deployer-policy.json; AccessDenied messages and ``python -m stagecoach.aws
    deployer-policy`` render it for the actual stack (``boundary``: the stack's JobRoleBoundaryArn
    output, instead of "policy/stagecoach/<stack>/*"). One wildcard resource is unavoidable: lambda:ListFunctions,
    states:ListStateMachines and lambda:GetAccountSettings support no resource-level permissions.

    No ECR permission: the stack's creation of the default worker from the same repository made
    Lambda add its pull permission to the repository policy (docs/aws.md).

    Nothing that changes, deletes or passes reaches the stack's own resources: its roles, its
    default worker (it runs as the control role, so new code, a new command or a new role there
    would run with that role) and its job state machine. Those statements name only what jobs
    get: their roles, their functions "<stack>-<job>-s<stage>...", their window machines.
    """
    arn = f"arn:{partition}"
    fn = f"{arn}:lambda:{region}:{account}:function:{stack}-*"
    path = f"{arn}:iam::{account}:role/stagecoach/{stack}/"
    bound = boundary or f"{arn}:iam::{account}:policy/stagecoach/{stack}/*"
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "ReadStack",
                "Effect": "Allow",
                "Action": ["cloudformation:DescribeStacks"],
                "Resource": f"{arn}:cloudformation:{region}:{account}:stack/{stack}/*",
            },
            *_s3_statements(f"{arn}:s3:::{bucket}"),
            *_lambda_statements(fn, stack),
            *_iam_statements(path, stack, bound),
            *_states_statements(f"{arn}:states:{region}:{account}", stack),
            # `stagecoach logs`: the stack's worker log group, where every function of the stack logs
            # (template.yaml WorkerLogGroup); the ":*" form is the one IAM uses for log-group actions
            {
                "Sid": "ReadWorkerLogs",
                "Effect": "Allow",
                "Action": ["logs:FilterLogEvents"],
                "Resource": f"{arn}:logs:{region}:{account}:log-group:/aws/lambda/{stack}-workers:*",
            },
            # Run.cost(), Run.failure(): an Express window's events, which Step Functions logs to the
            # stack's window log group (template.yaml WindowLogGroup) instead of keeping a history
            {
                "Sid": "ReadWindowLogs",
                "Effect": "Allow",
                "Action": ["logs:FilterLogEvents"],
                "Resource": f"{arn}:logs:{region}:{account}:log-group:/aws/vendedlogs/states/{stack}-windows:*",
            },
            # These support no resource-level permissions (IAM's service authorization reference):
            # the lists find a half-created job's functions and an existing window state machine;
            # GetAccountSettings is the account's Lambda concurrency, checked before a job starts.
            {
                "Sid": "ListFunctionsAndStateMachines",
                "Effect": "Allow",
                "Action": ["lambda:ListFunctions", "states:ListStateMachines", "lambda:GetAccountSettings"],
                "Resource": "*",
            },
        ],
    }


def _s3_statements(b: str) -> list[Statement]:
    """The stack's bucket ``b``: its objects under the prefixes the SDK writes, and listing them."""
    return [
        # jobs/: each job's objects; data/: datasets shared by jobs; history/: what a job's past
        # runs taught its next one (timeouts, memory; sdk/history.py). AbortMultipartUpload: a
        # data set's multipart upload that fails is aborted by boto3's transfer manager (the
        # bucket's lifecycle rule would otherwise bill its parts for a day)
        {
            "Sid": "JobObjects",
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
            "Resource": [f"{b}/jobs/*", f"{b}/data/*", f"{b}/history/*"],
        },
        # no s3:prefix condition: HeadBucket (the SDK's check that the bucket exists) has no prefix
        {"Sid": "ListJobObjects", "Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": b},
    ]


def _lambda_statements(fn: str, stack: str) -> list[Statement]:
    """The stack's functions ``fn`` ("<stack>-*"): the jobs' ("<stack>-*-s*") may be created and
    changed, and only with the stack's tag on them; the default worker ("<stack>-worker") only read."""
    jobs = f"{fn}-s*"  # "<stack>-<job>-s<stage>", "-r<i>"/"-k<i>" after it, "<stack>-<job>-prof-s<i>"
    return [
        # The SDK tags every function it creates with its stack; changing one requires that tag,
        # so the name pattern cannot reach another application's "<stack>-..." function. Creating
        # and tagging require the tag both in the request and on the function (as the Lambda
        # guide's ABAC example "Require tags on new functions" does): TagResource cannot adopt an
        # untagged function whose name happens to fit the pattern. The names are the jobs'
        # functions only: the default worker "<stack>-worker" has no "-s" after the stack's prefix.
        {
            "Sid": "CreateStageFunctions",
            "Effect": "Allow",
            "Action": ["lambda:CreateFunction", "lambda:TagResource"],
            "Resource": jobs,
            "Condition": {"StringEquals": {f"aws:RequestTag/{STACK_TAG}": stack, f"aws:ResourceTag/{STACK_TAG}": stack}},
        },
        {
            "Sid": "StageFunctions",
            "Effect": "Allow",
            "Action": [
                "lambda:UpdateFunctionCode",
                "lambda:UpdateFunctionConfiguration",
                "lambda:DeleteFunction",
                # Job.run(reserve_concurrency=True)
                "lambda:PutFunctionConcurrency",
            ],
            "Resource": jobs,
            "Condition": {"StringEquals": {f"aws:ResourceTag/{STACK_TAG}": stack}},
        },
        # reads: also of functions that do not exist (yet, or any more), which a tag condition
        # would answer with AccessDenied instead of ResourceNotFound; GetFunction of a tagged
        # function needs ListTags too; and of the default worker, whose image the jobs' use
        {
            "Sid": "ReadStageFunctions",
            "Effect": "Allow",
            "Action": ["lambda:GetFunction", "lambda:GetFunctionConfiguration", "lambda:ListTags"],
            "Resource": fn,
        },
        # profiling at memory tiers (Job.plan(profile_on=...)): the SDK invokes its own
        # "<stack>-<job>-prof-s<i>" functions synchronously, and no other function
        {
            "Sid": "ProfileFunctions",
            "Effect": "Allow",
            "Action": ["lambda:InvokeFunction"],
            "Resource": f"{fn}-prof-s*",
            "Condition": {"StringEquals": {f"aws:ResourceTag/{STACK_TAG}": stack}},
        },
    ]


def _iam_statements(path: str, stack: str, bound: str) -> list[Statement]:
    """The roles under the stack's ``path``: each job's, created only with the boundary ``bound``,
    and the window machines' role, passed to Step Functions."""
    # A job's role is "<stack>-<job id>", and a job id ends in 8 hex digits ("-prof" after them for
    # a profiling job): deploy/roles.py job_role_name, deploy/resources.py new_job_id,
    # profile_tiers.py. iam:DeleteRole has no condition key that could say more (IAM's service
    # authorization reference lists none for it), so the name is the scope. The stack's own roles
    # share the path, named by CloudFormation "<stack>-<LogicalId>-<random>" (template.yaml), and
    # would fit "<stack>-*-????????" only if that random part were exactly 8 characters; and even
    # then IAM refuses to delete a role that still has inline policies (DeleteConflict:
    # https://docs.aws.amazon.com/IAM/latest/APIReference/API_DeleteRole.html), which every stack
    # role has and which this policy can remove only from a role with the stack's boundary.
    jobs = [f"{path}{stack}-*-????????", f"{path}{stack}-*-????????-prof"]
    return [
        {
            "Sid": "JobRoles",
            "Effect": "Allow",
            "Action": ["iam:CreateRole", "iam:PutRolePolicy", "iam:DeleteRolePolicy"],
            "Resource": jobs,
            "Condition": {"ArnLike": {"iam:PermissionsBoundary": bound}},
        },
        {"Sid": "RemoveJobRoles", "Effect": "Allow", "Action": ["iam:DeleteRole"], "Resource": jobs},
        # functions run with their job's role; never the control role (the default worker's: a new
        # function running it would act as the stack's remediation) or the job machine's role
        {
            "Sid": "PassJobRoles",
            "Effect": "Allow",
            "Action": ["iam:PassRole"],
            "Resource": jobs,
            "Condition": {"StringEquals": {"iam:PassedToService": "lambda.amazonaws.com"}},
        },
        # the window machines run with the stack's WindowStatesRole (the StatesRoleArn output).
        # CloudFormation names it "<stack>-WindowStatesRole-<random>" but shortens the stack part
        # when the whole would pass IAM's 64 characters (aws/serverless-application-model
        # discussion 3262: "my-stack-na-MyFunctionRole-..."), so the pattern does not spell the
        # stack: the path, which the template sets to the stack's own, already scopes it.
        {
            "Sid": "PassWindowRole",
            "Effect": "Allow",
            "Action": ["iam:PassRole"],
            "Resource": f"{path}*-WindowStatesRole-*",
            "Condition": {"StringEquals": {"iam:PassedToService": "states.amazonaws.com"}},
        },
    ]


def _states_statements(states: str, stack: str) -> list[Statement]:
    """The per-job window and group machines ("<stack>-<job>-window", "-group"), the job machine ("<stack>-job") and
    their executions (``states``: the Step Functions ARN prefix of the stack's region and account).
    Only windows and groups are created, changed and deleted: the job machine is the stack's."""
    return [
        {
            "Sid": "WindowStateMachines",
            "Effect": "Allow",
            "Action": [
                "states:CreateStateMachine",
                "states:UpdateStateMachine",
                "states:DeleteStateMachine",
                "states:TagResource",
            ],
            "Resource": [f"{states}:stateMachine:{stack}-*-window", f"{states}:stateMachine:{stack}-*-group"],
        },
        # start and resume a job (the job machine), read a window's definition, list executions
        {
            "Sid": "StateMachines",
            "Effect": "Allow",
            "Action": ["states:DescribeStateMachine", "states:StartExecution", "states:ListExecutions"],
            "Resource": f"{states}:stateMachine:{stack}-*",
        },
        {
            "Sid": "Executions",
            "Effect": "Allow",
            "Action": ["states:DescribeExecution", "states:GetExecutionHistory", "states:StopExecution"],
            "Resource": f"{states}:execution:{stack}-*:*",
        },
    ]
