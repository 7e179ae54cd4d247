"""The `specserve` command: starts and supervises the services, and talks to a running stack."""
