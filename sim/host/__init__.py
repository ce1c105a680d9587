"""Effects of the host a rank runs on, applied to a built schedule (CPU ranks only)."""
