"""Stagecoach planner: pure functions and plain data, no AWS calls."""
