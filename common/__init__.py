"""Process plumbing shared by every specserve service: logging set-up and socket helpers."""
