"""The scheduler process: all request state, continuous batching, placement on workers, recovery."""
