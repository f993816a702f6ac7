"""Offline prefill:decode ratio planner: cost profile, cluster simulator, ratio search, and
the real-run harness of the ratio benchmark. See `pdserve plan` / `pdserve profile`."""
