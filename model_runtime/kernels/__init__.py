"""Compiled CPU kernels (built on first use) and their plain torch references."""
