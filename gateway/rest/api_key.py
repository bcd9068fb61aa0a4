"""Where a REST request carries its API key: OpenAI's ``Authorization: Bearer <key>`` or
Anthropic's ``x-api-key: <key>`` (what the official ``anthropic`` client sends)."""

from __future__ import annotations

from fastapi import Request


def authorization_of(request: Request) -> str | None:
    """The ``Authorization`` value ``gateway.keys.bearer_token`` reads: the header itself
    when sent, else ``Bearer <x-api-key>`` when that header is sent, else None (the
    authentication then answers 401 ``missing_api_key``)."""
    header = request.headers.get("authorization")
    if header:
        return header
    api_key = request.headers.get("x-api-key", "").strip()
    return f"Bearer {api_key}" if api_key else None
