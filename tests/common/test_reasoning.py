"""common/reasoning.py: the ``<think>`` splitter gives the same reasoning and answer for a
text fed whole or cut anywhere (every one- and two-cut split of each case, so a tag split
across token pieces is covered), under both parsers' conventions."""

from __future__ import annotations

import itertools

import pytest

from common.reasoning import REASONING_PARSERS, ReasoningSplitter, reasoning_format, split_reasoning

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]

CASES = [
    # (text, qwen3's (reasoning, content), deepseek_r1's)
    ("<think>\nLet me see.</think>\n\nHello", ("\nLet me see.", "Hello"), ("\nLet me see.", "Hello")),
    ("Hello <think>x</think>", ("", "Hello <think>x</think>"), ("Hello <think>x", "")),
    ("  <think>a</think>b", ("a", "b"), ("a", "b")),
    ("abc</think>\n\nxy", ("", "abc</think>\n\nxy"), ("abc", "xy")),
    ("<think>cut by max_tokens", ("cut by max_tokens", ""), ("cut by max_tokens", "")),
    ("<thi", ("", "<thi"), ("<thi", "")),
    ("a</thin", ("", "a</thin"), ("a</thin", "")),
    ("<think></think>", ("", ""), ("", "")),
    ("<think>a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),
    ("", ("", ""), ("", "")),
]


def _fed(text: str, cuts: tuple[int, ...], fmt) -> tuple[str, str]:
    splitter, reasoning, content, at = ReasoningSplitter(fmt), "", "", 0
    for cut in (*cuts, len(text)):
        out = splitter.feed(text[at:cut])
        reasoning, content, at = reasoning + out.reasoning, content + out.content, cut
    out = splitter.finish()
    return reasoning + out.reasoning, content + out.content


@pytest.mark.parametrize("text, qwen3, r1", CASES)
def test_whole_and_every_cut_agree(text, qwen3, r1):
    for fmt, expected in ((QWEN3, qwen3), (R1, r1)):
        whole = split_reasoning(text, fmt)
        assert (whole.reasoning, whole.content) == expected, fmt.name
        for k in (1, 2):
            for cuts in itertools.combinations(range(len(text) + 1), k):
                assert _fed(text, cuts, fmt) == expected, (fmt.name, cuts)


def test_a_partial_tag_is_held_until_told_apart():
    splitter = ReasoningSplitter(QWEN3)
    assert splitter.feed("<th").content == "" and splitter.feed("ink>I").reasoning == "I"
    out = splitter.feed("dea</thi")
    assert out.reasoning == "dea" and not splitter.closed
    out = splitter.feed("nk>\n\nOK")
    assert out.content == "OK" and splitter.closed


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_format("granite")


def test_reasoning_tokens_count_the_thinking_and_its_tags_whatever_the_cuts():
    from common.reasoning import count_reasoning_tokens

    qwen3, r1 = reasoning_format("qwen3"), reasoning_format("deepseek_r1")
    one_each = [("<think>", 1), ("a", 1), (" b", 1), ("</think>", 1), ("\n\n", 1), ("Hi", 1)]
    assert count_reasoning_tokens(one_each, qwen3) == 4
    cut = [(" ", 1), ("<th", 1), ("ink>", 1), ("x", 1), ("</th", 1), ("ink>", 1), ("ok", 1)]
    assert count_reasoning_tokens(cut, qwen3) == 6  # the held leading pieces count once decided
    assert count_reasoning_tokens([(" ", 1), ("Hi", 1), ("<think>", 1)], qwen3) == 0  # no thinking
    assert count_reasoning_tokens([("x", 2), ("</think>", 1), ("ok", 1)], r1) == 3  # opened by the prompt
    assert count_reasoning_tokens([("x", 1), ("y", 1)], r1) == 2  # cut by max_tokens while thinking
