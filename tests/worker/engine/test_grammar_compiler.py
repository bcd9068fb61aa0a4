"""GrammarCompiler.prepare: the worker builds llguidance's tokenizer ahead of the first
constrained request, on a compile thread, and compiles then reuse it."""

from __future__ import annotations

import types

import pytest

from tests.worker.fakes import fake_tokenizer
from worker.engine.grammar import GrammarCompiler, GrammarError


def test_prepare_builds_the_tokenizer_once_off_the_calling_thread():
    compiler = GrammarCompiler(fake_tokenizer(), fake_tokenizer().vocab_size)
    try:
        built = compiler.prepare().result(timeout=60)
        assert compiler.ll_tokenizer() is built
    finally:
        compiler.shutdown()


def test_prepare_reports_a_tokenizer_that_cannot_drive_a_grammar():
    compiler = GrammarCompiler(types.SimpleNamespace(eos_token_ids=frozenset({0})), 16)
    try:
        with pytest.raises(GrammarError, match="cannot drive a grammar"):
            compiler.prepare().result(timeout=60)
    finally:
        compiler.shutdown()
