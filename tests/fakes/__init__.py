"""Test doubles that run real gRPC servers without a model (used by router tests and benchmarks)."""
