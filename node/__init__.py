"""prime-node: the inference node (join flow, engines, rollouts, submission, slashing protection)."""
