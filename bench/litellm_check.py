"""What passes through LiteLLM proxy in front of inflight: the same requests sent with the
``openai`` client to inflight directly and through the proxy, side by side.

Not part of the test suite (it needs a running stack and a LiteLLM proxy; bench/README.md,
"Benchmark clients users already run", says how to start both with ``bench/litellm.yaml``).
Checks, each on both paths:

1. ``chat``: a greedy chat completion (max_tokens 8): status, text, ``model``, ``id``, usage.
2. ``stream``: the same streamed with ``stream_options.include_usage``: chunks, text, usage.
3. ``400``: ``max_tokens=-1`` (a parameter error) and a prompt over the context
   (``context_length_exceeded``): status, the error body and the exception class.
4. ``429``: a key limited to 2 requests/min (``inflight keys create ... --rpm 2``): two
   requests pass, the next one per path is refused: status, body, ``Retry-After`` and the
   ``x-ratelimit-*`` headers (LiteLLM prefixes the upstream's with ``llm_provider-``).
   Then one more through the proxy on the limited model (does LiteLLM's cooldown answer it
   itself?) and one on the unlimited model (not cooled down).
5. ``wait``: the limited key again, with the client's own retry on (``max_retries=1``): how
   long the ``openai`` client waits before its retry, through the proxy, then directly
   (it honours a ``Retry-After`` up to 120 s, else backs off 0.5-8 s). ``--skip-wait``
   leaves it out (it takes up to a minute).

Runs with only ``openai`` (and its ``httpx``) installed; retries are off (``max_retries=0``,
except in ``wait``) so every status is the server's. Prints one block per check; ``--json PATH`` also writes them.
Exit status 0 when every expectation listed in :data:`EXPECTED` held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import openai

RATE_HEADERS = ("retry-after", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests")


@dataclass
class Outcome:
    """One request's result as the caller sees it.

    Attributes:
        path: ``inflight`` (direct) or ``litellm`` (through the proxy).
        check: the check's name.
        status: HTTP status (200 on success).
        summary: the fields that matter for this check (text, usage, error body...).
        headers: rate-limit headers, bare or as LiteLLM forwards them (``llm_provider-...``).
    """

    path: str
    check: str
    status: int
    summary: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


def rate_headers(headers) -> dict[str, str]:
    """The rate-limit headers among ``headers`` (case-insensitive), LiteLLM's copies included."""
    out = {}
    for name, value in headers.items():
        bare = name.lower().removeprefix("llm_provider-")
        if bare in RATE_HEADERS:
            out[name.lower()] = value
    return out


def call(path: str, check: str, fn: Callable[[], Any]) -> Outcome:
    """Run ``fn`` (an ``openai`` call made ``with_raw_response``) and record what came back."""
    try:
        raw = fn()
    except openai.APIStatusError as err:
        try:
            body = err.response.json()
        except ValueError:
            body = err.response.text[:300]
        return Outcome(path, check, err.status_code,
                       {"exception": type(err).__name__, "body": body}, rate_headers(err.response.headers))
    parsed = raw.parse()
    if hasattr(parsed, "choices"):
        summary = {"id": parsed.id, "model": parsed.model, "text": parsed.choices[0].message.content,
                   "finish_reason": parsed.choices[0].finish_reason,
                   "usage": parsed.usage.model_dump(exclude_none=True) if parsed.usage else None}
    else:  # a stream
        chunks, text, usage, finish = 0, "", None, None
        for chunk in parsed:
            chunks += 1
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage.model_dump(exclude_none=True)
        summary = {"chunks": chunks, "text": text, "finish_reason": finish, "usage": usage}
    return Outcome(path, check, raw.http_response.status_code, summary, rate_headers(raw.headers))


def run_checks(args: argparse.Namespace) -> list[Outcome]:
    """Every check on both paths, in the order of the module docstring."""
    direct = openai.OpenAI(base_url=args.inflight.rstrip("/") + "/v1", api_key=args.inflight_key, max_retries=0,
                           timeout=args.timeout)
    limited_direct = direct.with_options(api_key=args.limited_key)
    proxy = openai.OpenAI(base_url=args.litellm.rstrip("/") + "/v1", api_key=args.litellm_key, max_retries=0,
                          timeout=args.timeout)
    clients = {"inflight": (direct, args.served_model, limited_direct, args.served_model),
               "litellm": (proxy, args.model, proxy, args.limited_model)}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = []
    for check, extra in (("chat", {}), ("stream", {"stream": True, "stream_options": {"include_usage": True}})):
        for path, (client, model, _, _) in clients.items():
            out.append(call(path, check, lambda: client.chat.completions.with_raw_response.create(
                model=model, messages=messages, max_tokens=8, temperature=0, **extra)))
    for check, kwargs in (("400 max_tokens=-1", {"messages": messages, "max_tokens": -1}),
                          ("400 context_length_exceeded",
                           {"messages": [{"role": "user", "content": "hi " * 9000}], "max_tokens": 8})):
        for path, (client, model, _, _) in clients.items():
            out.append(call(path, check, lambda: client.chat.completions.with_raw_response.create(
                model=model, **kwargs)))
    # The limited key: 2 requests/min in all, then both paths are refused.
    order = [("litellm", "429 key (1st, passes)"), ("inflight", "429 key (2nd, passes)"),
             ("litellm", "429 key (3rd)"), ("inflight", "429 key (4th)"),
             ("litellm", "429 key (5th, limited model again)")]
    for path, check in order:
        _, _, client, model = clients[path]
        out.append(call(path, check, lambda: client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=4, temperature=0)))
    out.append(call("litellm", "after the 429: unlimited model", lambda: proxy.chat.completions.with_raw_response.create(
        model=args.model, messages=messages, max_tokens=4, temperature=0)))
    if not args.skip_wait:
        for path in ("litellm", "inflight"):
            _, _, client, model = clients[path]
            retrying = client.with_options(max_retries=1)
            start = time.monotonic()
            outcome = call(path, "wait (max_retries=1)", lambda: retrying.chat.completions.with_raw_response.create(
                model=model, messages=messages, max_tokens=4, temperature=0))
            outcome.summary = {"elapsed_s": round(time.monotonic() - start, 1), **outcome.summary}
            out.append(outcome)
    return out


EXPECTED: dict[tuple[str, str], int] = {
    ("inflight", "chat"): 200, ("litellm", "chat"): 200,
    ("inflight", "stream"): 200, ("litellm", "stream"): 200,
    ("inflight", "400 max_tokens=-1"): 400, ("litellm", "400 max_tokens=-1"): 400,
    ("inflight", "400 context_length_exceeded"): 400, ("litellm", "400 context_length_exceeded"): 400,
    ("litellm", "429 key (1st, passes)"): 200, ("inflight", "429 key (2nd, passes)"): 200,
    ("litellm", "429 key (3rd)"): 429, ("inflight", "429 key (4th)"): 429,
    ("litellm", "after the 429: unlimited model"): 200,
    ("inflight", "wait (max_retries=1)"): 200,  # waited Retry-After, then the window had room
}


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the checks, print them; 0 when every :data:`EXPECTED` status held."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inflight", default="http://127.0.0.1:8080", help="inflight's edge URL")
    p.add_argument("--inflight-key", required=True, help="an inflight key without limits")
    p.add_argument("--limited-key", required=True, help="an inflight key made with --rpm 2, unused this minute")
    p.add_argument("--litellm", default="http://127.0.0.1:4000", help="the LiteLLM proxy's URL")
    p.add_argument("--litellm-key", required=True, help="LiteLLM's master key (or a virtual key)")
    p.add_argument("--model", default="smollm2", help="LiteLLM model_name of the unlimited key")
    p.add_argument("--limited-model", default="smollm2-limited", help="LiteLLM model_name of the limited key")
    p.add_argument("--served-model", default="SmolLM2-135M-Instruct", help="inflight's model id")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--skip-wait", action="store_true", help="leave out the client-retry check (up to a minute)")
    p.add_argument("--json", help="also write the outcomes here")
    args = p.parse_args(argv)
    outcomes = run_checks(args)
    failed = 0
    for o in outcomes:
        want = EXPECTED.get((o.path, o.check))
        mark = "" if want is None else (" ok" if o.status == want else f" EXPECTED {want}")
        failed += bool(mark.startswith(" EXPECTED"))
        print(f"[{o.check}] {o.path}: {o.status}{mark}")
        print("   ", json.dumps(o.summary, ensure_ascii=False)[:400])
        if o.headers:
            print("   ", json.dumps(o.headers))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(o) for o in outcomes], f, indent=1)
    print(f"{len(outcomes) - failed} as expected, {failed} not")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
