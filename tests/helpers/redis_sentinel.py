"""A throw-away Redis Sentinel set for tests: :mod:`stack.redis_sentinel` (a master, one
replica and three sentinels on free loopback ports), which the chaos soak uses too."""

from stack.redis_sentinel import SERVICE, SentinelSet, start_sentinel_set

__all__ = ["SERVICE", "SentinelSet", "start_sentinel_set"]
