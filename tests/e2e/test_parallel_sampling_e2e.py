"""Parallel sampling (``n`` > 1) end to end: the official ``openai`` client through nginx,
the gateway, Redis and the worker running the real SmolLM2."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import wait_all_blocks_free

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
PROMPT = [{"role": "user", "content": "Tell me about cats."}]


def test_openai_client_gets_n_choices(stack, rest_url, api_key):
    client = openai.OpenAI(base_url=f"{rest_url}/v1", api_key=api_key, max_retries=0, timeout=120)
    sampled = client.chat.completions.create(model=MODEL, messages=PROMPT, n=3, temperature=1,
                                             seed=1234, max_tokens=16)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    texts = [c.message.content for c in sampled.choices]
    assert all(texts) and len(set(texts)) > 1, texts  # each choice has its own seed
    assert all(c.finish_reason in ("stop", "length") for c in sampled.choices)
    assert sampled.usage.completion_tokens > 16  # summed over the choices, prompt counted once
    single = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=1)
    assert sampled.usage.prompt_tokens == single.usage.prompt_tokens
    # choice 0 of a seeded request samples what n = 1 would
    alone = client.chat.completions.create(model=MODEL, messages=PROMPT, temperature=1, seed=1234,
                                           max_tokens=16)
    assert alone.choices[0].message.content == texts[0]

    greedy = client.chat.completions.create(model=MODEL, messages=PROMPT, n=2, temperature=0,
                                            max_tokens=16)
    assert len(greedy.choices) == 2
    assert greedy.choices[0].message.content == greedy.choices[1].message.content

    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=PROMPT, n=2, temperature=0,
                                                max_tokens=16, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert streamed == {0: greedy.choices[0].message.content, 1: greedy.choices[1].message.content}
    wait_all_blocks_free(stack)
