"""The target worker process: one model replica, its KV cache, and the steps it is sent."""
