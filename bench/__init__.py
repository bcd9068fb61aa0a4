"""Benchmarks of inflight: static vs dynamic vs continuous batching, peers, hardware ceiling (see docs/BENCHMARKS.md and bench/README.md)."""
