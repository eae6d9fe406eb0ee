"""Benchmarks that produce the rows of BENCHMARKS.md (rerun them; quote ratios measured in one run)."""
