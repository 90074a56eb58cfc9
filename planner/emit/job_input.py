"""The job state machine's execution input: written by the SDK (sdk/deploy/start.py), read by the
job definition's JSONPaths (asl.job_definition; tests/test_asl.py checks that every path it reads
is a field here). Field names are the ASL's, hence camelCase.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Window(BaseModel):
    """Iterations [start, end) run by one window execution, and that execution's timeout."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start: int = Field(ge=0)
    end: int = Field(gt=0)
    timeout: int = Field(gt=0)


class JobInput(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    job: str
    bucket: str
    windowStateMachineArn: str
    windows: list[Window]
    functionPrefix: str  # a stage's function is functionPrefix + its index
    controlFunction: str  # where the remediation step runs (the stack's own worker)
