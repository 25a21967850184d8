"""Where each call runs: the plan, the registered placement presets, the placement and its groups, the heartbeat,
wrappers, tensor-parallel copies."""
