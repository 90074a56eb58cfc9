"""Profile: what the planner knows of a model, layer by layer (sizes, FLOPs, measured times)."""
