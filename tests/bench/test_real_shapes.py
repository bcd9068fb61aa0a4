"""bench/real_shapes.py: the GGUF it writes reads back with the right keys, shapes and types
(a tiny shape and a tiny stand-in tokenizer, so no llama.cpp and well under a second)."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from bench.real_shapes import LLAMA3_ROPE_SCALING, SHAPES, Shape, llama3_rope_factors, make, tensor_plan, write_f16

TINY = Shape("tiny", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128,
             rope_scaling=LLAMA3_ROPE_SCALING)
VOCAB = 300


@pytest.fixture()
def tokenizer_gguf(tmp_path):
    """A GGUF holding only tokenizer keys (the real writer copies every ``tokenizer.*`` key)."""
    path = tmp_path / "tok.gguf"
    w = GGUFWriter(path, "llama")
    w.add_string("general.name", "not copied")
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(VOCAB)])
    w.add_key_value("tokenizer.ggml.token_type", [1] * VOCAB, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    w.add_array("tokenizer.ggml.merges", ["t 1", "t 2"])
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def test_tiny_shape_reads_back(tmp_path, tokenizer_gguf):
    path = tmp_path / "tiny.gguf"
    write_f16(path, TINY, tokenizer_gguf, seed=3)
    assert not (tmp_path / "tiny.gguf.part").exists()
    r = GGUFReader(path)
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.architecture"] == "llama"
    assert f["llama.block_count"] == 2 and f["llama.embedding_length"] == 64
    assert f["llama.attention.head_count"] == 4 and f["llama.attention.head_count_kv"] == 2
    assert f["llama.feed_forward_length"] == 128 and f["llama.rope.dimension_count"] == 16
    assert f["llama.rope.freq_base"] == 500000.0 and f["llama.vocab_size"] == VOCAB
    assert f["general.file_type"] == 1  # MOSTLY_F16
    # The tokenizer keys are copied with their types; nothing else of the source file is.
    assert f["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(VOCAB)]
    assert f["tokenizer.ggml.token_type"] == [1] * VOCAB
    assert r.fields["tokenizer.ggml.token_type"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    assert f["tokenizer.ggml.merges"] == ["t 1", "t 2"] and f["tokenizer.ggml.eos_token_id"] == 2
    assert f["tokenizer.ggml.add_bos_token"] is False and f["tokenizer.chat_template"] == "{{ messages }}"
    assert f["general.name"] != "not copied"

    tensors = {t.name: t for t in r.tensors}
    assert "output.weight" not in tensors  # tied embeddings
    assert [t.name for t in r.tensors] == [name for name, _, _ in tensor_plan(TINY, VOCAB)]
    # GGUF dims are ne0 first: (in_features, out_features).
    expect = {"token_embd.weight": [64, VOCAB], "rope_freqs.weight": [8], "output_norm.weight": [64],
              "blk.1.attn_norm.weight": [64], "blk.1.attn_q.weight": [64, 64], "blk.1.attn_k.weight": [64, 32],
              "blk.1.attn_v.weight": [64, 32], "blk.1.attn_output.weight": [64, 64],
              "blk.1.ffn_norm.weight": [64], "blk.1.ffn_gate.weight": [64, 128],
              "blk.1.ffn_up.weight": [64, 128], "blk.1.ffn_down.weight": [128, 64]}
    for name, dims in expect.items():
        t = tensors[name]
        assert [int(d) for d in t.shape] == dims, name
        assert t.tensor_type.name == ("F32" if len(dims) == 1 else "F16"), name
    assert np.all(tensors["blk.0.ffn_norm.weight"].data == 1)
    np.testing.assert_array_equal(tensors["rope_freqs.weight"].data, llama3_rope_factors(TINY))
    embd = tensors["token_embd.weight"].data.astype(np.float32)
    assert abs(float(embd.std()) - 0.02) < 0.001 and abs(float(embd.mean())) < 0.001
    # A fixed seed gives the same bytes; another seed does not.
    again = tmp_path / "again.gguf"
    write_f16(again, TINY, tokenizer_gguf, seed=3)
    assert again.read_bytes() == path.read_bytes()
    other = tmp_path / "other.gguf"
    write_f16(other, TINY, tokenizer_gguf, seed=4)
    assert other.read_bytes() != path.read_bytes()


def test_rope_factors_follow_llama3_scaling():
    factors = llama3_rope_factors(SHAPES["1b"])
    assert factors.shape == (32,) and factors[0] == 1.0 and factors[-1] == 32.0
    assert np.all(np.diff(factors) >= 0)  # high frequencies untouched, low ones divided by 32


def test_real_shapes_parameter_counts():
    counts = {name: sum(int(np.prod(d)) for _, d, kind in tensor_plan(s, 49152) if kind != "rope_freqs")
              for name, s in SHAPES.items()}
    assert round(counts["1b"] / 1e9, 2) == 1.07 and round(counts["3b"] / 1e9, 2) == 2.97
    # With Llama 3's own vocabulary the counts are the published 1.24 B and 3.21 B.
    real = {name: sum(int(np.prod(d)) for _, d, kind in tensor_plan(s, 128256) if kind != "rope_freqs")
            for name, s in SHAPES.items()}
    assert round(real["1b"] / 1e9, 2) == 1.24 and round(real["3b"] / 1e9, 2) == 3.21


def test_make_is_idempotent_and_quantizes_through_the_binary(tmp_path, tokenizer_gguf):
    fake = tmp_path / "llama-quantize"  # stands in for llama.cpp: copies src to dst, logs the call
    log = tmp_path / "calls"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\ncp "$1" "$2"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "models"
    paths = make(out, TINY, ["Q8_0"], fake, tokenizer_gguf)
    assert [p.name for p in paths] == ["llama-tiny-f16.gguf", "llama-tiny-Q8_0.gguf"]
    assert log.read_text().split() == [str(out / "llama-tiny-f16.gguf"), str(out / "llama-tiny-Q8_0.gguf.part"),
                                       "Q8_0", "2"]
    mtimes = [os.stat(p).st_mtime_ns for p in paths]
    make(out, TINY, ["Q8_0"], fake, tokenizer_gguf)
    assert [os.stat(p).st_mtime_ns for p in paths] == mtimes and len(log.read_text().splitlines()) == 1
    # Without the binary only a missing quantized file is an error.
    make(out, TINY, ["Q8_0"], None, tokenizer_gguf)
    with pytest.raises(FileNotFoundError):
        make(out, TINY, ["Q4_K_M"], None, tokenizer_gguf)
    # --drop-f16: the F16 file goes once every type exists, and is not rewritten for them.
    make(out, TINY, ["Q8_0"], fake, tokenizer_gguf, drop_f16=True)
    assert not (out / "llama-tiny-f16.gguf").exists() and (out / "llama-tiny-Q8_0.gguf").exists()
