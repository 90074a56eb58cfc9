"""Deploy: put a planned job onto a stack (upload, functions, state machines) and start it; remove it again."""
