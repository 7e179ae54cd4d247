"""Wire contracts shared by every specserve process: gRPC API, ZeroMQ messages, lifecycle states."""
