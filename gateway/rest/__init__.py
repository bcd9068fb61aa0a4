"""The OpenAI-compatible REST front (FastAPI)."""

from gateway.rest.app import create_app

__all__ = ["create_app"]
