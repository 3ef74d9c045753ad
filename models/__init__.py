"""What the network runs: model loading, forward pass with hidden states, generation engine, sampler."""
