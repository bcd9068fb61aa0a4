"""One parsed GGUF header per file, shared by everything in a process that reads it.

``gguf.GGUFReader`` parses a file's metadata into one numpy view per value; on a file with a
49,152-token vocabulary that is about 150,000 views, and as views of its ``np.memmap`` each one
runs ``memmap.__array_finalize__``: the parse took seconds, and a worker paid it once for the
tokenizer and once for the weights. :class:`MappedGGUFReader` gives the parser a plain
``np.ndarray`` view of the same memory map (no copy; the map stays open through the view's
``base``), which more than halves the parse (bench/RESULTS.md run 37), and :func:`gguf_reader`
keeps the parsed reader per file so the second reader in the process costs nothing.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from gguf import GGUFReader


class MappedGGUFReader(GGUFReader):
    """``gguf.GGUFReader`` over a plain ``np.ndarray`` view of its memory map.

    Same fields, tensors and values as the library's reader; tensor ``data`` arrays are
    ``np.ndarray`` views (read-only, backed by the file) instead of ``np.memmap`` ones.

    Raises:
        FileNotFoundError: no file at the path; ValueError: not a GGUF file (as GGUFReader)."""

    @property
    def data(self) -> np.ndarray:
        """The whole file as uint8, a view of the memory map."""
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        """Keep ``value`` (the library's ``np.memmap``) as a plain ``np.ndarray`` view, no copy."""
        self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value


def gguf_reader(path: str | Path) -> MappedGGUFReader:
    """The parsed reader of the GGUF file at ``path``, kept per resolved path, modification time
    and size (two files at most), so the tokenizer, the startup check and the weights' load
    share one parse.

    Raises:
        FileNotFoundError: no file at ``path``; ValueError: not a GGUF file."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    return _reader(str(resolved), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int, size: int) -> MappedGGUFReader:
    return MappedGGUFReader(path)
