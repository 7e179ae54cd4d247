"""The draft service: proposers of speculative tokens, behind the same lifecycle as a target worker."""
