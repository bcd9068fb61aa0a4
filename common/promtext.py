"""Reading values out of a Prometheus text exposition (``/metrics``) with
prometheus-client's own parser, for the demo, the benchmark and the tests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample_sum(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of every sample called ``name`` (e.g. ``inflight_requests_running`` or
    ``inflight_time_to_first_token_seconds_count``) whose labels include ``labels``;
    0.0 when there is none."""
    wanted = (labels or {}).items()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and wanted <= s.labels.items())
