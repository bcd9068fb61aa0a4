"""Stored ``/v1/responses`` responses (``store: true``, OpenAI's default): what
``previous_response_id`` continues from and ``GET``/``DELETE /v1/responses/{id}`` read.

One Redis string per response, ``inflight:responses:{key_id}:{response_id}``
(``common.redis_keys.response_key``), JSON of the response object and the conversation
up to and including its output as chat messages, with a TTL
(``GatewaySettings.responses_ttl_s``). The API key's id is part of the name, so a key
only ever reads, continues or deletes its own responses: another key's id is simply not
found (404), the same answer as an id that never existed or expired.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from common.redis_keys import response_key
from gateway.errors import redis_unavailable


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    Attributes:
        response: the response object as the client got it (JSON-ready dict).
        messages: the conversation as chat messages, this response's output included and
            its ``instructions`` left out (OpenAI does not carry them over).
    """

    response: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponsesStore:
    """Responses of each API key in Redis under a TTL.

    Args:
        client: the gateway's Redis client.
        ttl_s: seconds a response stays stored (>= 1).
    """

    def __init__(self, client: redis.asyncio.Redis, ttl_s: int) -> None:
        self._redis = client
        self._ttl_s = ttl_s

    async def save(self, key_id: str, stored: StoredResponse) -> None:
        """Store ``stored`` under its response's id for ``key_id``.

        Raises:
            UnavailableError: Redis unreachable.
        """
        value = json.dumps({"response": stored.response, "messages": stored.messages})
        await self._call(self._redis.set(response_key(key_id, stored.response["id"]), value,
                                         ex=self._ttl_s))

    async def load(self, key_id: str, response_id: str) -> StoredResponse | None:
        """The response ``response_id`` of ``key_id``; None when absent, expired, or another key's.

        Raises:
            UnavailableError: Redis unreachable.
        """
        raw = await self._call(self._redis.get(response_key(key_id, response_id)))
        if raw is None:
            return None
        data = json.loads(raw)
        return StoredResponse(data["response"], data["messages"])

    async def delete(self, key_id: str, response_id: str) -> bool:
        """Delete the response; True when it was there.

        Raises:
            UnavailableError: Redis unreachable.
        """
        return bool(await self._call(self._redis.delete(response_key(key_id, response_id))))

    @staticmethod
    async def _call(awaitable: Any) -> Any:
        try:
            return await awaitable
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise redis_unavailable("the responses store", exc) from exc
