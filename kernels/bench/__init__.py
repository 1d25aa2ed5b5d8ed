"""Kernel benchmarks (CPU and GPU): timings for the records, never for tests."""
