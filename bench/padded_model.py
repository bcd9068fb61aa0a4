"""A trained model in a shape the K-quants take: SmolLM2-135M-Instruct padded from width 576 to 768.

Why: a K-quant super-block holds 256 values of a row, so every projection's input width must be a
multiple of 256. SmolLM2's 576 is not, nothing can be downloaded here, and the random-weight files
of :mod:`bench.real_shapes` have nearly flat next-token distributions, on which a teacher-forced
top-1 score flips on near-ties (bench/RESULTS.md runs 36 and 42). This file is the default model
itself, padded so that it computes the same function:

- width 576 -> 768: the embedding's columns and the output rows of ``attn_output`` and ``ffn_down``
  are padded with zeros, so the padded part of the residual stream stays zero. RMSNorm then
  divides by the root mean square over 768 values, ``c = 576 / 768`` times the one over 576, so
  the norm weights are scaled by ``sqrt(c)`` and the epsilon by ``c``: ``x / sqrt(c m + c eps)
  sqrt(c) w = x / sqrt(m + eps) w`` exactly;
- heads 9 -> 12 and KV heads 3 -> 4, so the attention output (heads x 64) is 768 wide too and
  the group stays 3 (query head h still reads KV head h // 3): the new heads' q, k and v rows and
  their ``attn_output`` columns are zero, so they attend uniformly over zero values and add nothing.

FFN 1536 is already 6 x 256. The weights come from the default GGUF (Q4_1 projections, Q8_0
embedding) dequantized by the ``gguf`` package, written F16 (F32 norms) with every other
metadata key copied, then quantized by llama.cpp's ``llama-quantize`` (built by
``bench/peers/build_llama_server.sh``), as :mod:`bench.real_shapes` does::

    python -m bench.padded_model [--out ~/.cache/inflight/models] [--types Q4_K_M] [--layers N]

writes ``smollm2-768-f16.gguf`` and ``smollm2-768-<TYPE>.gguf`` (``--layers N`` keeps the first N
blocks, names ``smollm2-768-<N>l-*``; ``--unpadded`` writes the same blocks at width 576, the
test's reference). Idempotent like :mod:`bench.real_shapes`. Used by bench/RESULTS.md run 44
(``python -m bench.quant_accuracy --model .../smollm2-768-Q4_K_M.gguf --gguf-only``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.real_shapes import DEFAULT_OUT, _find_llama_quantize, quantize

WIDTH, HEADS, KV_HEADS = 768, 12, 4  # the padded shape
ARCH = "llama"


@dataclass(frozen=True)
class Source:
    """The original model's shape, read from its GGUF header."""

    width: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float

    @property
    def c(self) -> float:
        """Original width over padded width: the ratio of the two mean squares."""
        return self.width / WIDTH


def _pad(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """``a`` (2-D) in the top-left corner of a ``[rows, cols]`` zero matrix."""
    out = np.zeros((rows, cols), dtype=np.float32)
    out[: a.shape[0], : a.shape[1]] = a
    return out


def pad_tensor(name: str, a: np.ndarray, src: Source) -> np.ndarray:
    """One tensor of the padded model from the original's float32 ``a`` (GGUF row-major:
    ``[out_features, in_features]`` for a matrix). Raises KeyError for a tensor it does not know."""
    kind = name.rsplit(".", 2)[-2]
    if kind in ("attn_norm", "ffn_norm", "output_norm"):
        out = np.zeros(WIDTH, dtype=np.float32)
        out[: src.width] = a * math.sqrt(src.c)
        return out
    if kind in ("token_embd", "output", "ffn_gate", "ffn_up"):  # input columns only
        return _pad(a, a.shape[0], WIDTH)
    if kind in ("attn_q", "attn_k", "attn_v"):  # rows are heads of head_dim rows: the new heads zero
        return _pad(a, (HEADS if kind == "attn_q" else KV_HEADS) * src.head_dim, WIDTH)
    if kind == "attn_output":
        return _pad(a, WIDTH, HEADS * src.head_dim)
    if kind == "ffn_down":
        return _pad(a, WIDTH, a.shape[1])
    raise KeyError(f"{name}: no padding rule")


def read_source(reader) -> Source:
    """The original's shape from a ``gguf.GGUFReader``; ValueError when it cannot be padded."""
    f = {k: v.contents() for k, v in reader.fields.items() if k.startswith(f"{ARCH}.")}
    width, heads, kv = f[f"{ARCH}.embedding_length"], f[f"{ARCH}.attention.head_count"], f[f"{ARCH}.attention.head_count_kv"]
    src = Source(width, heads, kv, width // heads, f[f"{ARCH}.attention.layer_norm_rms_epsilon"])
    if width > WIDTH or heads > HEADS or kv > KV_HEADS or HEADS // KV_HEADS != heads // kv or HEADS * src.head_dim != WIDTH:
        raise ValueError(f"cannot pad width {width}, {heads} heads, {kv} KV heads to {WIDTH}, {HEADS}, {KV_HEADS}")
    return src


def _block_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def write_f16(source_gguf: Path, path: Path, layers: int | None = None, padded: bool = True) -> None:
    """The (padded) model as F16 matrices and F32 vectors, atomically (``.part`` + rename)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize

    reader = GGUFReader(source_gguf)
    src = read_source(reader)
    blocks = reader.fields[f"{ARCH}.block_count"].contents()
    keep = blocks if layers is None else min(layers, blocks)
    overrides = {f"{ARCH}.block_count": keep, "general.file_type": int(LlamaFileType.MOSTLY_F16)}
    if padded:
        overrides |= {f"{ARCH}.embedding_length": WIDTH, f"{ARCH}.attention.head_count": HEADS,
                      f"{ARCH}.attention.head_count_kv": KV_HEADS,
                      f"{ARCH}.attention.layer_norm_rms_epsilon": src.eps * src.c}
    part = path.with_name(path.name + ".part")
    writer = GGUFWriter(part, ARCH)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub_type = field.types[1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, overrides.get(key, field.contents()), vtype, sub_type=sub_type)
    tensors = [t for t in reader.tensors if _block_of(t.name) is None or _block_of(t.name) < keep]
    for t in tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        a = pad_tensor(t.name, a, src) if padded else a
        writer.add_tensor(t.name, a if a.ndim == 1 else a.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(part, path)


def make(out: Path, types: list[str], layers: int | None = None, padded: bool = True,
         llama_quantize: Path | None = None, threads: int = 2) -> list[Path]:
    """The F16 file and each quantized type under ``out``; files that exist are kept."""
    from common.model_files import resolve_model_path

    out.mkdir(parents=True, exist_ok=True)
    stem = f"smollm2-{WIDTH if padded else 'unpadded'}" + (f"-{layers}l" if layers else "")
    f16 = out / f"{stem}-f16.gguf"
    if not f16.exists():
        write_f16(Path(resolve_model_path(None)), f16, layers, padded)
    made = [f16]
    for qtype in types:
        dst = out / f"{stem}-{qtype}.gguf"
        if not dst.exists():
            if llama_quantize is None:
                raise FileNotFoundError("llama-quantize not found: build it with bench/peers/build_llama_server.sh "
                                        "or pass --llama-quantize PATH")
            quantize(llama_quantize, f16, dst, qtype, threads)
        made.append(dst)
    return made


def main(argv: list[str] | None = None) -> int:
    """Write the files; print their paths."""
    p = argparse.ArgumentParser(prog="python -m bench.padded_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default %(default)s)")
    p.add_argument("--types", default="Q4_K_M", help="comma-separated llama-quantize types ('' = F16 only)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N blocks")
    p.add_argument("--unpadded", action="store_true", help="the same blocks at the original width (a reference)")
    p.add_argument("--llama-quantize", default=None, help="llama-quantize binary (default: the bench's build)")
    p.add_argument("--threads", type=int, default=2, help="llama-quantize threads (default %(default)s)")
    args = p.parse_args(argv)
    types = [t for t in args.types.split(",") if t]
    try:
        paths = make(Path(args.out).expanduser(), types, args.layers, not args.unpadded,
                     _find_llama_quantize(args.llama_quantize) if types else None, args.threads)
    except (FileNotFoundError, ValueError) as exc:
        print(f"bench.padded_model: {exc}", file=sys.stderr)
        return 1
    print("\n".join(str(path) for path in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
