"""The seed papers' and FuncPipe §5.1's planners, as their papers define them: compared, never on the plan path."""
