"""The planner's commands (`planner ...`), their output and preflight; the top layer."""
