"""Reading raw SSE bodies in tests: each event's ``data`` and ``id`` fields."""

from __future__ import annotations


def sse_events(text: str) -> list[dict[str, str]]:
    """The events of an SSE body (blank-line separated), each as ``{field: value}``
    (``data`` and, on every chunk of inflight's streams, ``id``)."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            name, _, value = line.partition(": ")
            fields[name] = value
        events.append(fields)
    return events


def sse_data(text: str) -> list[str]:
    """The ``data`` of every event of an SSE body, in order (``[DONE]`` included)."""
    return [event["data"] for event in sse_events(text) if "data" in event]
