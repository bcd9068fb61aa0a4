"""Startup checks of a GGUF file, before anything maps its tensors: a truncated or corrupt
file, one whose tensors disagree with its header, or one that will not fit the memory left.

``gguf.GGUFReader`` maps the whole file and slices it: a header cut short fails deep in numpy
(``IndexError``, "cannot reshape array"), a length field gone wrong can make it loop, and a
K-quant tensor kept as a view of the map (:mod:`worker.model.kquant`) that reaches past the
end of the file would end the process with SIGBUS at its first product. So the header is
walked here first with plain bounded reads (:func:`read_header`: every length is checked
against the bytes left before it is followed), then every tensor's data range, block
alignment and shape are checked against the file's size and the header's config
(:func:`check_gguf_file`). Each refusal is one ``ValueError`` line,
``"<file name>: <what is wrong>"``, which ``inflight worker``/``up`` print before anything starts.

:func:`check_fits_memory` refuses, before loading, a model whose weights (as the loader will
hold them, :func:`model_memory_bytes`) and KV cache exceed what the host still has
(:func:`worker.model.host_memory.available_bytes`, the measure the dense copies use).

Layout (the GGUF spec, ggml's docs/gguf.md): magic ``GGUF``, version (u32), tensor count and
metadata count (u64 each), the metadata (key string, value type u32, value), one info per tensor
(name string, dimension count u32, dimensions u64 innermost first, type u32, offset u64 from the
data section), then the data section at the next multiple of ``general.alignment`` (32).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # as gguf.GGUFReader (version 1 had 32-bit counts)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MIN_ITEM = {_STRING: 8, _ARRAY: 12}  # the fewest bytes a string / nested array item takes
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_MiB = 2**20


class ModelTooLarge(ValueError):
    """The model and its KV cache would not fit the memory available (:func:`check_fits_memory`)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF header.

    Attributes:
        name: its GGUF name (``blk.0.attn_q.weight``).
        dims: its dimensions, innermost first (GGUF's order: ``[in, out]`` for a weight).
        kind: its ggml type's name (``Q4_K``, ``F32``).
        start: absolute byte offset of its data in the file.
        nbytes: its data's size in bytes (from the type's block size and bytes per block).
    """

    name: str
    dims: tuple[int, ...]
    kind: str
    start: int
    nbytes: int

    @property
    def end(self) -> int:
        """The byte after its data."""
        return self.start + self.nbytes

    @property
    def n_values(self) -> int:
        """Values in the tensor: the product of its dimensions."""
        n = 1
        for d in self.dims:
            n *= d
        return n


@dataclass(frozen=True)
class GGUFHeader:
    """What :func:`read_header` read: ``metadata`` holds scalars and strings by key (an array's
    value is its item count, as :class:`ArrayLength`), ``tensors`` in header order."""

    version: int
    metadata: dict
    tensors: tuple[TensorInfo, ...]
    data_start: int
    file_size: int


@dataclass(frozen=True)
class ArrayLength:
    """An array value of the metadata, kept as its item count."""

    count: int


class _Short(Exception):
    """A read past the end of the file (caught and reworded by :func:`read_header`)."""

    def __init__(self, what: str, at: int, need: int):
        super().__init__(what)
        self.what, self.at, self.need = what, at, need


class _Cursor:
    """Bounded reads of the header: each read checks the bytes left first."""

    def __init__(self, file, size: int, order: str):
        self.file, self.size, self.order, self.pos = file, size, order, 0

    def need(self, n: int, what: str) -> None:
        """Raise :class:`_Short` (naming ``what``) unless ``n`` more bytes are left."""
        if n < 0 or self.pos + n > self.size:
            raise _Short(what, self.pos, n)

    def read(self, n: int, what: str) -> bytes:
        """The next ``n`` bytes; :class:`_Short` when the file has fewer (or shrank meanwhile)."""
        self.need(n, what)
        data = self.file.read(n)
        if len(data) != n:  # the file shrank while we read it
            raise _Short(what, self.pos, n)
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        """Move past ``n`` bytes, checked as :meth:`need`."""
        self.need(n, what)
        self.pos += n
        self.file.seek(self.pos)

    def scalar(self, fmt: str, what: str):
        """One ``struct`` value of format ``fmt`` in the file's byte order."""
        return struct.unpack(self.order + fmt, self.read(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> bytes:
        """A GGUF string: a uint64 length, then that many bytes."""
        return self.read(self.scalar("Q", what), what)


def _fail(path: Path, what: str) -> ValueError:
    return ValueError(f"{path.name}: {what}")


def read_header(path: str | Path) -> GGUFHeader:
    """Read a GGUF file's header with bounded reads (never a memory map), and check its
    structure: magic, version, every length within the file, known value and tensor types, no
    key or tensor twice, at most 4 dimensions, each row a whole number of its type's blocks,
    each tensor's data aligned, inside the file and apart from the others. The answer is kept per
    path, size and modification time (a worker's start asks more than once).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: one line, ``"<file name>: <what is wrong>"``.
    """
    path = Path(path).resolve()
    stat = path.stat()
    return _read_header(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_header(path_text: str, size: int, mtime_ns: int) -> GGUFHeader:
    path = Path(path_text)
    if size == 0:
        raise _fail(path, "empty file (0 bytes), not a GGUF model")
    with open(path, "rb") as file:
        first = file.read(8)
        if len(first) < 8 and MAGIC.startswith(first[:4]):
            raise _fail(path, f"truncated: the file is {size} bytes, shorter than a GGUF header")
        if first[:4] != MAGIC:
            raise _fail(path, f"not a GGUF file (it starts with {first[:4]!r}, a GGUF file with {MAGIC!r})")
        version = struct.unpack("<I", first[4:8])[0]
        order = "<"
        if version & 0xFFFF == 0:  # written on a machine of the other byte order (as gguf.GGUFReader reads it)
            order, version = ">", struct.unpack(">I", first[4:8])[0]
        if version not in SUPPORTED_VERSIONS:
            raise _fail(path, f"GGUF version {version} unsupported (supported: "
                              f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
        cursor = _Cursor(file, size, order)
        cursor.skip(8, "the version")
        try:
            return _read_rest(cursor, path, version)
        except _Short as short:
            raise _fail(path, f"truncated or corrupt header: {short.what} at byte {short.at} needs {short.need} "
                              f"bytes, but the file ends at byte {size}") from None


def _read_rest(cursor: _Cursor, path: Path, version: int) -> GGUFHeader:
    tensor_count = cursor.scalar("Q", "the tensor count")
    kv_count = cursor.scalar("Q", "the metadata count")
    if kv_count * 12 > cursor.size - cursor.pos:  # a key (8-byte length) and a type (4) at least each
        raise _Short(f"{kv_count} metadata entries", cursor.pos, kv_count * 12)
    metadata: dict = {}
    for index in range(kv_count):
        key = _text(path, cursor.string(f"metadata key #{index}"), f"metadata key #{index}")
        if key in metadata:
            raise _fail(path, f"metadata key {key!r} appears twice")
        value_type = cursor.scalar("I", f"the type of {key!r}")
        metadata[key] = _value(cursor, path, value_type, key)
    if tensor_count * 24 > cursor.size - cursor.pos:  # name length, dimension count, type, offset at least
        raise _Short(f"{tensor_count} tensor infos", cursor.pos, tensor_count * 24)
    infos = [_tensor_info(cursor, path, index) for index in range(tensor_count)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata and (not isinstance(alignment, int) or isinstance(alignment, bool)
                                            or alignment <= 0 or alignment & (alignment - 1)):
        raise _fail(path, f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = tuple(_tensor(path, info, data_start, alignment) for info in infos)
    _check_ranges(path, tensors, data_start, cursor.size)
    return GGUFHeader(version, metadata, tensors, data_start, cursor.size)


def _text(path: Path, raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(path, f"corrupt header: {what} is not UTF-8 ({raw[:40]!r})") from None


def _value(cursor: _Cursor, path: Path, value_type: int, key: str):
    """One metadata value: a scalar, a string, or an array's item count (its items skipped)."""
    if value_type in _SCALARS:
        value = cursor.scalar(_SCALARS[value_type], f"the value of {key!r}")
        if key == "general.alignment" and value_type != _UINT32:
            raise _fail(path, f"general.alignment has value type {value_type}, not uint32")
        return value
    if value_type == _STRING:
        return cursor.string(f"the value of {key!r}").decode("utf-8", "replace")
    if value_type == _ARRAY:
        return ArrayLength(_skip_array(cursor, path, key))
    raise _fail(path, f"corrupt header: metadata {key!r} has unknown value type {value_type}")


def _skip_array(cursor: _Cursor, path: Path, key: str) -> int:
    """Skip an array value (its items bounded by the bytes left first); its item count."""
    item_type = cursor.scalar("I", f"the item type of {key!r}")
    count = cursor.scalar("Q", f"the length of {key!r}")
    if item_type in _SCALARS:
        cursor.skip(count * struct.calcsize(_SCALARS[item_type]), f"the {count} items of {key!r}")
    elif item_type in _MIN_ITEM:
        cursor.need(count * _MIN_ITEM[item_type], f"the {count} items of {key!r}")
        for _ in range(count):
            if item_type == _STRING:
                cursor.skip(cursor.scalar("Q", f"an item of {key!r}"), f"an item of {key!r}")
            else:
                _skip_array(cursor, path, key)
    else:
        raise _fail(path, f"corrupt header: array {key!r} has unknown item type {item_type}")
    return count


def _tensor_info(cursor: _Cursor, path: Path, index: int) -> tuple[str, tuple[int, ...], int, int]:
    what = f"tensor info #{index}"
    name = _text(path, cursor.string(what), f"the name of {what}")
    n_dims = cursor.scalar("I", f"the dimension count of {name!r}")
    if n_dims > MAX_DIMS:
        raise _fail(path, f"corrupt header: tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
    dims = struct.unpack(cursor.order + "Q" * n_dims, cursor.read(8 * n_dims, f"the dimensions of {name!r}"))
    type_id = cursor.scalar("I", f"the type of {name!r}")
    offset = cursor.scalar("Q", f"the offset of {name!r}")
    return name, dims, type_id, offset


def _tensor(path: Path, info: tuple[str, tuple[int, ...], int, int], data_start: int, alignment: int) -> TensorInfo:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    name, dims, type_id, offset = info
    try:
        kind = GGMLQuantizationType(type_id)
        block, block_bytes = GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise _fail(path, f"corrupt header: tensor {name!r} has unknown type id {type_id}") from None
    n_values = 1
    for d in dims:
        n_values *= d
    if n_values >= 2**62:
        raise _fail(path, f"corrupt header: tensor {name!r} has dimensions {list(dims)}")
    if dims and dims[0] % block:
        raise _fail(path, f"tensor {name!r} is {kind.name} with rows of {dims[0]} values, not a whole number of "
                          f"its {block}-value blocks")
    if offset % alignment:
        raise _fail(path, f"corrupt header: tensor {name!r} starts at data offset {offset}, not a multiple of "
                          f"the alignment {alignment}")
    return TensorInfo(name, tuple(dims), kind.name, data_start + offset, n_values // block * block_bytes)


def _check_ranges(path: Path, tensors: tuple[TensorInfo, ...], data_start: int, size: int) -> None:
    names: set[str] = set()
    for tensor in tensors:
        if tensor.name in names:
            raise _fail(path, f"corrupt header: tensor {tensor.name!r} appears twice")
        names.add(tensor.name)
    if data_start > size and tensors:
        raise _fail(path, f"truncated: the file is {size} bytes and ends before its tensor data (byte {data_start})")
    past = [t for t in tensors if t.end > size]
    if past:
        first = min(past, key=lambda t: t.start)
        end = max(t.end for t in tensors)
        more = f" and {len(past) - 1} more" if len(past) > 1 else ""
        raise _fail(path, f"truncated: the file is {size} bytes but its tensor data runs to byte {end} "
                          f"({end - size} missing; tensor {first.name!r}{more} past the end)")
    ordered = sorted(tensors, key=lambda t: t.start)
    for before, after in zip(ordered, ordered[1:]):
        if after.start < before.end:
            raise _fail(path, f"corrupt header: tensors {before.name!r} and {after.name!r} overlap "
                              f"(bytes {before.start}..{before.end} and {after.start}..{after.end})")


def check_gguf_file(path: str | Path) -> GGUFHeader:
    """Refuse a truncated or corrupt GGUF file, or one whose tensors disagree with its header,
    before anything reads or maps its tensors; the header on success.

    Checked: the structure (:func:`read_header`); a ``token_embd.weight`` whose width is
    ``{arch}.embedding_length`` and with a row for every token of ``tokenizer.ggml.tokens``;
    tensors ``blk.N.*`` for exactly the blocks ``0 .. {arch}.block_count - 1``; the shapes of the
    attention and MLP weights, norms and biases from ``embedding_length``, ``attention.head_count``,
    ``head_count_kv``, ``key_length`` and ``feed_forward_length`` (each check only where the
    header has its integers); the output matrix as wide and tall as the embedding.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: one line, ``"<file name>: <what is wrong>"``.
    """
    header = read_header(path)
    _check_shapes(Path(path), header)
    return header


def _int(meta: dict, key: str) -> int | None:
    value = meta.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_shapes(path: Path, header: GGUFHeader) -> None:
    meta, tensors = header.metadata, {t.name: t for t in header.tensors}
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        return  # worker.model.gguf_loader.gguf_config names the missing architecture
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise _fail(path, "no token_embd.weight tensor")
    hidden = _int(meta, f"{arch}.embedding_length")
    if hidden is not None and embd.dims[:1] != (hidden,):
        raise _fail(path, f"token_embd.weight is {list(embd.dims)} (GGUF order, width first) but "
                          f"{arch}.embedding_length is {hidden}")
    rows = embd.dims[1] if len(embd.dims) == 2 else None
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, ArrayLength) and rows is not None and tokens.count > rows:
        raise _fail(path, f"the tokenizer has {tokens.count} tokens but token_embd.weight only {rows} rows")
    _check_blocks(path, meta, arch, tensors)
    if hidden is None:
        return
    for name, want, why in _expected_shapes(meta, arch, hidden, rows, tensors):
        tensor = tensors.get(name)
        if tensor is not None and tensor.dims != want:
            raise _fail(path, f"tensor {name!r} is {list(tensor.dims)} (GGUF order) but the header makes it "
                              f"{list(want)} ({why})")


def _check_blocks(path: Path, meta: dict, arch: str, tensors: dict) -> None:
    count = _int(meta, f"{arch}.block_count")
    if count is None:
        return
    present = {int(n) for n in (name.split(".")[1] for name in tensors if name.startswith("blk."))
               if n.isdigit()}
    beyond = sorted(n for n in present if n >= count)
    if beyond:
        raise _fail(path, f"{arch}.block_count is {count} but the file has tensors of block {beyond[0]}")
    missing = sorted(set(range(count)) - present)
    if missing:
        raise _fail(path, f"{arch}.block_count is {count} but no tensors of block {missing[0]}"
                          f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")


def _expected_shapes(meta: dict, arch: str, hidden: int, rows: int | None, tensors: dict):
    """``(name, GGUF-order dims, why)`` of the tensors whose shapes the header fixes."""
    heads = _int(meta, f"{arch}.attention.head_count")
    kv_heads = _int(meta, f"{arch}.attention.head_count_kv") or heads
    ff = _int(meta, f"{arch}.feed_forward_length")
    yield "output_norm.weight", (hidden,), f"embedding_length {hidden}"
    if rows is not None:
        yield "output.weight", (hidden, rows), f"embedding_length {hidden}, token_embd's {rows} rows"
    blocks = sorted({name.split(".")[1] for name in tensors if name.startswith("blk.")})
    for n in blocks:
        b = f"blk.{n}."
        yield b + "attn_norm.weight", (hidden,), f"embedding_length {hidden}"
        yield b + "ffn_norm.weight", (hidden,), f"embedding_length {hidden}"
        if heads:
            head_dim = _int(meta, f"{arch}.attention.key_length") or hidden // heads
            q, kv = heads * head_dim, kv_heads * head_dim
            why = f"embedding_length {hidden}, {heads} heads and {kv_heads} kv heads of {head_dim}"
            yield b + "attn_q.weight", (hidden, q), why
            yield b + "attn_k.weight", (hidden, kv), why
            yield b + "attn_v.weight", (hidden, kv), why
            yield b + "attn_qkv.weight", (hidden, q + 2 * kv), why
            yield b + "attn_output.weight", (q, hidden), why
            yield b + "attn_q.bias", (q,), why
            yield b + "attn_k.bias", (kv,), why
            yield b + "attn_v.bias", (kv,), why
            yield b + "attn_q_norm.weight", (head_dim,), why
            yield b + "attn_k_norm.weight", (head_dim,), why
        if ff:
            why = f"embedding_length {hidden}, feed_forward_length {ff}"
            yield b + "ffn_gate.weight", (hidden, ff), why
            yield b + "ffn_up.weight", (hidden, 2 * ff if arch == "phi3" else ff), why  # phi3: gate and up fused
            yield b + "ffn_down.weight", (ff, hidden), why


# bytes a GGUF block format takes once ``gguf`` repacks it, per byte of the file
# (worker.model.block_weights.Q4Weight: 160 bytes per 8 rows of 32 values, as the file's 20 per row;
#  Q8Weight: 288 + 8 float32 scales per 8 rows of 32, against the file's 34 per row)
_REPACKED_PER_FILE_BYTE = {"q4_1": 1.0, "q8_0": 40 / 34}


def model_memory_bytes(path: str | Path, quantization: str) -> int:
    """Bytes of memory the model at ``path`` (a GGUF file) takes once loaded with the resolved
    ``quantization`` (:func:`worker.model.quantization.resolve_quantization`, not ``auto``).

    Under ``gguf``: a 2-D K-quant tensor (:data:`worker.model.gguf_formats.KQUANT_FORMATS`) is a
    view of the file's map, counted as its file bytes (the pages it makes resident); a Q4_1 or Q8_0
    projection or output matrix (:data:`~worker.model.gguf_formats.GGUF_BLOCK_FORMATS`) is
    repacked to about its file bytes (Q8_0 40 bytes per 34); an embedding not in K-quant blocks is
    float32 for the lookups, plus its repacked blocks when it is also the (tied) output matrix.
    Everything else, and every tensor under the other quantizations (the loader dequantizes them
    to float32 first), counts 4 bytes per value. Not counted: the loader's transient float32
    copies of Q4_1/Q8_0 tensors before they are repacked, and the dense bfloat16 copies
    (``--dense-weights-min-rows``, which :func:`worker.model.dense_weights.fit_dense_to_memory` sizes).

    Raises:
        FileNotFoundError, ValueError: as :func:`check_gguf_file`.
    """
    from worker.model.gguf_formats import GGUF_BLOCK_FORMATS, KQUANT_FORMATS

    header = read_header(path)
    names = {t.name for t in header.tensors}
    total = 0
    for tensor in header.tensors:
        kind = tensor.kind.lower()
        float_bytes = 4 * tensor.n_values
        if quantization != "gguf" or tensor.name in _ROPE_TENSORS:
            total += float_bytes
        elif kind in KQUANT_FORMATS and len(tensor.dims) == 2:
            total += tensor.nbytes
        elif kind in GGUF_BLOCK_FORMATS and tensor.name == "token_embd.weight":
            tied = "output.weight" not in names
            total += float_bytes + (int(tensor.nbytes * _REPACKED_PER_FILE_BYTE[kind]) if tied else 0)
        elif kind in GGUF_BLOCK_FORMATS and len(tensor.dims) == 2:
            total += int(tensor.nbytes * _REPACKED_PER_FILE_BYTE[kind])
        else:
            total += float_bytes
    return total


def check_fits_memory(path: str | Path, quantization: str, kv_cache_bytes: int,
                      available: int | None = None) -> None:
    """Refuse, before loading, a GGUF model whose weights (:func:`model_memory_bytes`) and
    ``kv_cache_bytes`` (the KV cache the host will hold, bytes) exceed ``available`` bytes
    (default :func:`worker.model.host_memory.available_bytes`: ``MemAvailable`` lowered to the
    process's cgroup limits). Nothing is refused when the available memory is unknown (None).

    Raises:
        ModelTooLarge: (a ValueError) one line naming the file, the estimate and what was
            free, in MiB.
        FileNotFoundError, ValueError: as :func:`check_gguf_file`.
    """
    if available is None:
        from worker.model import host_memory

        available = host_memory.available_bytes()
    if available is None:
        return
    weights = model_memory_bytes(path, quantization)
    if weights + kv_cache_bytes > available:
        raise ModelTooLarge(
            f"{Path(path).name}: will not fit in memory: about {(weights + kv_cache_bytes) / _MiB:.0f} MiB needed "
            f"({weights / _MiB:.0f} MiB of weights under --quantization {quantization}, "
            f"{kv_cache_bytes / _MiB:.0f} MiB of KV cache) but {available / _MiB:.0f} MiB free "
            f"(MemAvailable and cgroup limits); a smaller model, quantization or --kv-cache-mib")
