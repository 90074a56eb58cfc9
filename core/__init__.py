"""The shared core: what the SDK and the workers both rely on, and nothing that only one of them runs.

Object keys (``keys``), the records that cross a process boundary through S3 (``records``), the
events a worker accepts (``events``), the training arithmetic the workers and the single-process
reference share (``training``, ``optim_state``, ``schedule``, ``boundary``), data sets as workers
read them (``samples``), building one stage (``stagebuild``, ``graph_split``), measuring layers
(``profiling``), the billing arithmetic (``cost``) and the emulated network's settings (``netem``).
Each rule lives here once; the worker runtime (``stagecoach.lambdas``) and the SDK import it, and it
imports only the planner's plan contract below it (docs/architecture.md "Layers").
"""
