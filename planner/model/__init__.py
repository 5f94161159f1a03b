"""The pure state machine of a model: what to write, decided from what was read.

Nothing here does I/O. `transition.decide(document, observation, event, rules, now)`
returns a `transition.Plan`: the next state document, the effects on Nomad (values,
`effects`) and notes for logs. The daemon reads (`planner.daemon.observe`), decides
here, and writes through its one writer (`planner.daemon.applier`).
"""
