"""Shared test helpers (private Redis server, ...)."""
