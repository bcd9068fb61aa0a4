"""Benchmarks of inflight: static vs dynamic vs continuous batching, peers, hardware ceiling (see README.md)."""
