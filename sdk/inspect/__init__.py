"""Inspect: a run read back from Step Functions histories and its task metrics (report, failed tasks, plots)."""
