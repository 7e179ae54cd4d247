"""The gateway process: the public gRPC API, tokenization, detokenization and stop strings in front of the scheduler."""
