"""`prime-devnet`: the whole network on one machine (anvil, trainer with its SHARDCAST origin, relays,
validators, CPU nodes), started as processes in one state directory; status, down, audit."""
