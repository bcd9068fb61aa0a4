"""The shared argparse types say what they expected, in the option's own error line."""

from __future__ import annotations

import argparse

import pytest

from common.cli_types import auto_or_non_negative_int, non_negative_int, positive_int


def parse_error(type_fn, value: str, capsys) -> str:
    parser = argparse.ArgumentParser(prog="inflight worker")
    parser.add_argument("--rows", type=type_fn)
    with pytest.raises(SystemExit):
        parser.parse_args(["--rows", value])
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_word_where_a_count_goes_names_what_was_expected(capsys):
    assert parse_error(auto_or_non_negative_int, "abc", capsys) == (
        "inflight worker: error: argument --rows: expected auto or an integer >= 0, got 'abc'")
    assert parse_error(non_negative_int, "1.5", capsys).endswith("expected an integer >= 0, got '1.5'")
    assert parse_error(positive_int, "x", capsys).endswith("expected an integer >= 1, got 'x'")
    assert "auto_or_non_negative_int" not in parse_error(auto_or_non_negative_int, "abc", capsys)


def test_ranges_and_auto():
    assert auto_or_non_negative_int("auto") is None and auto_or_non_negative_int("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="must be auto or >= 0, got -1"):
        auto_or_non_negative_int("-1")
    with pytest.raises(argparse.ArgumentTypeError, match="must be >= 1, got 0"):
        positive_int("0")
