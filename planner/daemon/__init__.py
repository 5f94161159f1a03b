"""What the leading `planner serve` runs: election, the watcher loops, per-model
workers, the applier (the only Nomad writer), activation, idle scale-down, repair."""
