"""KV-cache-aware routing of queued requests to the worker that holds their prompt's prefix
(``router.py``: the fleet's state from Redis; ``scoring.py``: the choice)."""
