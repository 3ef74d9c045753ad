"""`prime-validator`: the daemon that checks nodes' rollouts, records verdicts, slashes on chain and feeds the trainer."""
