"""Stream interval: how many of a request's tokens the worker sends in one ``Delta``.

Every engine step produces one token per running sequence. Sent one by one,
each token costs a link message entry, a gateway wake-up and a message to the
client, and on a machine whose cores the worker shares with the gateway (the
single-box stack) that work is taken from the engine's step. With an interval
of N the worker holds a request's tokens until it has N unsent ones, so the
gateway and the client see about 1/N as many messages, at the price of text
arriving in chunks of N tokens.

The rules are those of SGLang's and vLLM's ``--stream-interval`` (default 1):
the first token goes out at once (TTFT is unchanged), later tokens go out when
N are pending, and whatever is pending goes out with the request's last output.
Tokens held when a request is cancelled, handed back, or its link or the worker
dies are dropped, never sent: a continuation resumes after the last token the
gateway delivered (DESIGN.md, "worker dies"), so nothing is lost or repeated.
They are not charged either: a cancelled request's tokens/min reservation is
settled on what was delivered. A large N makes a stream silent for up to N steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protos import common_pb2, link_pb2


@dataclass
class _Pending:
    """Output of one request not sent yet."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)


class StreamBuffer:
    """Coalesces each request's per-step output into deltas of up to ``interval`` tokens.

    Args:
        interval: tokens per delta after the first, >= 1 (1 = every token at once).

    Raises:
        ValueError: interval < 1.
    """

    def __init__(self, interval: int = 1):
        if interval < 1:
            raise ValueError(f"stream interval must be >= 1 token, got {interval}")
        self.interval = interval
        self._pending: dict[tuple[str, int], _Pending] = {}  # (request id, choice index) -> held output
        self._started: set[tuple[str, int]] = set()  # choices whose first token went out

    def push(self, request_id: str, text: str, token_ids: list[int],
             logprobs: list[common_pb2.TokenLogprob], finished: bool, index: int = 0) -> link_pb2.Delta | None:
        """Add one step's output of choice ``index`` of ``request_id``; return the delta
        to send now, if any.

        A delta is due for the choice's first token, when ``interval`` tokens are
        pending, and with its last output (``finished``), which also forgets the choice.
        """
        key = (request_id, index)
        pending = self._pending.setdefault(key, _Pending())
        if text:
            pending.text.append(text)
        pending.token_ids.extend(token_ids)
        pending.logprobs.extend(logprobs)
        due = (finished or len(pending.token_ids) >= self.interval
               or (pending.token_ids and key not in self._started))
        delta = None
        if due and (pending.token_ids or pending.text):
            delta = link_pb2.Delta(request_id=request_id, text="".join(pending.text),
                                   token_ids=pending.token_ids, logprobs=pending.logprobs, index=index)
            self._started.add(key)
            self._pending[key] = _Pending()
        if finished:
            self._pending.pop(key, None)
            self._started.discard(key)
        return delta

    def drop(self, request_id: str) -> None:
        """Forget every choice of ``request_id`` and discard its unsent output (cancel,
        abort, hand-back)."""
        for key in [k for k in self._pending if k[0] == request_id]:
            del self._pending[key]
        self._started = {k for k in self._started if k[0] != request_id}

    def clear(self) -> None:
        """Forget every request."""
        self._pending.clear()
        self._started.clear()

    def __len__(self) -> int:
        """Requests being tracked."""
        return len(self._pending)
