"""Gateway admission, in the design's order: authenticate → validate → per-key sliding windows →
in-flight cap → queue-depth backpressure; the entry point is ``pipeline.Admission``.

- ``pipeline``: :class:`~gateway.admission.pipeline.Admission`, the order, rejections counted.
- ``params``: :class:`~gateway.admission.params.RequestParams`, what a front asks validation to check.
- ``validation``: parameters and prompt into a ``ValidatedRequest``.
- ``request_id``: a client-chosen request id.
- ``key_limits``: a key's caps, priority class and a request's cost in tokens.
- ``workers``: no worker heartbeat, no admission (``require_worker``).
- ``ratelimit``, ``ratelimit_lua`` + ``admit.lua``/``release.lua``: windows, in-flight cap and
  queue depth in one Redis script, and the refund.
"""
