"""Where each call runs: the plan, the placement and its groups, the heartbeat, wrappers, tensor-parallel copies."""
