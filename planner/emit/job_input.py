"""The job state machine's execution input: written by the SDK (sdk/deploy/start.py), read by the
job definition's JSONPaths (asl.job_definition; tests/test_asl.py checks that every path it reads
is a field here, and every field is read). Field names are the ASL's, hence camelCase.

Its size does not grow with the number of iterations: the state machine computes the windows
itself, and continues as a new execution (``link`` + 1) every ``windowsPerExecution`` windows.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class JobInput(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    job: str
    bucket: str
    windowStateMachineArn: str
    iterations: int = Field(gt=0)
    windowLength: int = Field(gt=0)  # iterations per window execution (asl.window_length)
    windowTimeout: int = Field(gt=0)  # seconds a window execution may take
    # the window state machine's type: STANDARD (startExecution.sync:2) or EXPRESS (startSyncExecution)
    windowType: Literal["STANDARD", "EXPRESS"] = "STANDARD"
    windowsPerExecution: int = Field(gt=0)  # before continuing as a new execution (asl.windows_per_execution)
    functionPrefix: str  # a stage's function is functionPrefix + its index
    controlFunction: str  # where the remediation step runs (the stack's own worker)
    # this execution's place in the chain: {job}, {job}-c1, ...; a resumption ({job}-r{n}) starts
    # from the job's latest continuation number, so its own continuations take new names
    link: int = Field(default=0, ge=0)
    start: int = Field(default=0, ge=0)  # the first iteration this execution runs
    windowsHere: int = Field(default=0, ge=0)  # windows run by this execution so far


def link_name(job: str, link: int) -> str:
    """The job execution's name: the job id, then ``{job}-c{link}`` for each continuation."""
    return job if link == 0 else f"{job}-c{link}"
