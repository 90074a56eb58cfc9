"""Emit: a plan as Step Functions state machines (ASL as plain data)."""
