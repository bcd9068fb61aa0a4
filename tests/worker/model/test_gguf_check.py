"""A truncated or corrupt GGUF file, one whose tensors disagree with its header, or a model
that will not fit the memory left is refused at startup in one line naming the file and what
is wrong (worker/model/gguf_check.py), through the real startup paths: ``check_model`` (what
``inflight worker``/``up`` call first), ``load_model_runner`` and the worker's command line. A
file cut short must never reach ``gguf.GGUFReader``'s numpy errors or a SIGBUS from the
K-quant views of its memory map."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from worker.model import host_memory
from worker.model.gguf_check import ModelTooLarge, check_gguf_file, model_memory_bytes, read_header
from worker.model.loader import check_model
from worker.model.model_runner import load_model_runner

gguf = pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory) -> Path:
    """A tiny Q4_K_M-style Llama (tests/worker/model/test_kquant_model.py)."""
    from tests.worker.model.test_kquant_model import write_llama

    path = tmp_path_factory.mktemp("gguf") / "llama.gguf"
    write_llama(path, ["Q4_K", "Q6_K"])
    return path


def write_tiny(path: Path, *, embedding_length: int = 64, embd_width: int = 64, block_count: int = 2,
               blocks: int = 2, q_rows: int = 64) -> None:
    """A tiny float32 Llama whose header and tensors can be made to disagree."""
    rng = np.random.default_rng(0)
    hidden, heads, inter, vocab = 64, 4, 128, 32
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(block_count)
    writer.add_context_length(128)
    writer.add_embedding_length(embedding_length)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_layer_norm_rms_eps(1e-5)

    def add(name: str, *shape: int) -> None:
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    add("token_embd.weight", vocab, embd_width)
    add("output_norm.weight", hidden)
    for i in range(blocks):
        add(f"blk.{i}.attn_q.weight", q_rows, hidden)
        for name in ("attn_k", "attn_v", "attn_output"):
            add(f"blk.{i}.{name}.weight", hidden, hidden)
        add(f"blk.{i}.ffn_gate.weight", inter, hidden)
        add(f"blk.{i}.ffn_up.weight", inter, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, inter)
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def cut(source: Path, tmp_path: Path, size: int) -> Path:
    """A copy of ``source`` holding only its first ``size`` bytes."""
    path = tmp_path / source.name
    path.write_bytes(source.read_bytes()[:size])
    return path


def patched(source: Path, tmp_path: Path, at: int, data: bytes) -> Path:
    """A copy of ``source`` with ``data`` written over the bytes at ``at``."""
    raw = bytearray(source.read_bytes())
    raw[at:at + len(data)] = data
    path = tmp_path / source.name
    path.write_bytes(bytes(raw))
    return path


def tensor_info_at(source: Path, name: str) -> int:
    """Byte offset of tensor ``name``'s dimension count in the header (just after its name)."""
    raw = source.read_bytes()
    encoded = name.encode()
    return raw.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


def refusal(path: Path) -> str:
    """The one-line message ``check_model`` (the worker's startup check) refuses ``path`` with."""
    with pytest.raises(ValueError) as info:
        check_model(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path.name}: "), message
    return message


def test_whole_files_pass(kquant_file, tmp_path):
    tiny = tmp_path / "tiny.gguf"
    write_tiny(tiny)
    for path in (kquant_file, tiny):
        header = check_gguf_file(path)
        assert header.tensors and header.file_size == path.stat().st_size
        assert max(t.end for t in header.tensors) <= header.file_size
        check_model(path)


def test_the_default_model_passes():
    from common.model_files import default_model_path

    header = check_gguf_file(default_model_path())
    assert len(header.tensors) == 272  # SmolLM2-135M: 30 blocks of 9 and token_embd, output_norm


@pytest.mark.parametrize("missing", [1, 100, 5000, "half the data", "all the data"])
def test_a_file_cut_in_its_data_is_refused_with_the_bytes_missing(kquant_file, tmp_path, missing):
    size = kquant_file.stat().st_size
    header = read_header(kquant_file)
    if missing == "half the data":
        missing = (size - header.data_start) // 2
    elif missing == "all the data":
        missing = size - header.data_start
    message = refusal(cut(kquant_file, tmp_path, size - missing))
    assert f": truncated: the file is {size - missing} bytes but its tensor data runs to byte {size} " \
           f"({missing} missing; tensor " in message, message


@pytest.mark.parametrize("keep", [0, 3, 6, 20, 100, 400, "before the last tensor info"])
def test_a_file_cut_in_its_header_is_refused(kquant_file, tmp_path, keep):
    if keep == "before the last tensor info":
        keep = tensor_info_at(kquant_file, "blk.1.ffn_norm.weight") + 10
    message = refusal(cut(kquant_file, tmp_path, keep))
    if keep == 0:
        assert message == "llama.gguf: empty file (0 bytes), not a GGUF model"
    elif keep < 8:
        assert message == f"llama.gguf: truncated: the file is {keep} bytes, shorter than a GGUF header"
    else:
        assert message.startswith("llama.gguf: truncated or corrupt header: ")
        assert message.endswith(f"but the file ends at byte {keep}")


def test_a_cut_file_never_reaches_the_memory_map_through_load_model_runner(kquant_file, tmp_path):
    last = max((t for t in read_header(kquant_file).tensors if t.kind.endswith("_K")), key=lambda t: t.end)
    path = cut(kquant_file, tmp_path, last.end - 64)  # the last K-quant tensor's last rows gone
    with pytest.raises(ValueError, match=r"^llama\.gguf: truncated: the file is \d+ bytes but its tensor data .*"
                                         f"tensor '{last.name}' and 2 more past the end"):
        load_model_runner(path, quantization="auto", dtype="float32", block_size=8, num_blocks=4)


def test_a_bad_magic_or_version_is_refused(kquant_file, tmp_path):
    assert refusal(patched(kquant_file, tmp_path, 0, b"GGML")) == \
        "llama.gguf: not a GGUF file (it starts with b'GGML', a GGUF file with b'GGUF')"
    assert refusal(patched(kquant_file, tmp_path, 4, struct.pack("<I", 7))) == \
        "llama.gguf: GGUF version 7 unsupported (supported: 2, 3)"
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello, this is not a model\n")
    assert refusal(not_gguf) == "notes.gguf: not a GGUF file (it starts with b'hell', a GGUF file with b'GGUF')"


def test_a_corrupt_length_is_refused_without_following_it(kquant_file, tmp_path):
    # the first metadata key's length (after magic, version and the two counts) made huge
    message = refusal(patched(kquant_file, tmp_path, 24, struct.pack("<Q", 2**60)))
    assert message.startswith("llama.gguf: truncated or corrupt header: metadata key #0 at byte 32 needs "
                              f"{2**60} bytes"), message
    # a huge tensor count
    message = refusal(patched(kquant_file, tmp_path, 8, struct.pack("<Q", 2**40)))
    assert message.startswith(f"llama.gguf: truncated or corrupt header: {2**40} tensor infos at byte "), message


def test_a_row_not_a_whole_number_of_blocks_is_refused(kquant_file, tmp_path):
    at = tensor_info_at(kquant_file, "blk.0.ffn_down.weight") + 4  # the first (innermost) dimension
    message = refusal(patched(kquant_file, tmp_path, at, struct.pack("<Q", 300)))
    assert message.startswith("llama.gguf: tensor 'blk.0.ffn_down.weight' is Q") and \
        message.endswith("with rows of 300 values, not a whole number of its 256-value blocks"), message


def test_overlapping_tensors_are_refused(kquant_file, tmp_path):
    info = tensor_info_at(kquant_file, "blk.1.ffn_down.weight")
    at = info + 4 + 2 * 8 + 4  # past the dimension count, two dimensions and the type: the offset
    message = refusal(patched(kquant_file, tmp_path, at, struct.pack("<Q", 0)))
    assert message.startswith("llama.gguf: corrupt header: tensors ") and " overlap (bytes " in message, message


def test_an_unknown_tensor_type_is_refused(kquant_file, tmp_path):
    at = tensor_info_at(kquant_file, "output_norm.weight") + 4 + 8  # one dimension, then the type
    message = refusal(patched(kquant_file, tmp_path, at, struct.pack("<I", 99)))
    assert message == "llama.gguf: corrupt header: tensor 'output_norm.weight' has unknown type id 99"


def test_token_embd_wider_than_the_header_says_is_refused(tmp_path):
    path = tmp_path / "wide.gguf"
    write_tiny(path, embd_width=96)
    assert refusal(path) == ("wide.gguf: token_embd.weight is [96, 32] (GGUF order, width first) but "
                             "llama.embedding_length is 64")
    with pytest.raises(ValueError, match=r"^wide\.gguf: token_embd\.weight is \[96, 32\]"):
        load_model_runner(path, quantization="none", dtype="float32", block_size=8, num_blocks=4)


def test_block_count_unlike_the_blocks_present_is_refused(tmp_path):
    fewer = tmp_path / "fewer.gguf"
    write_tiny(fewer, block_count=3)
    assert refusal(fewer) == "fewer.gguf: llama.block_count is 3 but no tensors of block 2"
    more = tmp_path / "more.gguf"
    write_tiny(more, block_count=1)
    assert refusal(more) == "more.gguf: llama.block_count is 1 but the file has tensors of block 1"


def test_a_projection_unlike_the_header_is_refused(tmp_path):
    path = tmp_path / "q.gguf"
    write_tiny(path, q_rows=48)
    assert refusal(path) == ("q.gguf: tensor 'blk.0.attn_q.weight' is [64, 48] (GGUF order) but the header makes "
                             "it [64, 64] (embedding_length 64, 4 heads and 4 kv heads of 16)")


def test_the_memory_estimate_counts_kquants_as_their_file_bytes(kquant_file, tmp_path):
    header = read_header(kquant_file)
    kquants = sum(t.nbytes for t in header.tensors if t.kind.endswith("_K"))
    floats = sum(4 * t.n_values for t in header.tensors if t.kind == "F32")
    assert model_memory_bytes(kquant_file, "gguf") == kquants + floats
    assert model_memory_bytes(kquant_file, "none") == sum(4 * t.n_values for t in header.tensors)
    tiny = tmp_path / "tiny.gguf"
    write_tiny(tiny)
    assert model_memory_bytes(tiny, "gguf") == model_memory_bytes(tiny, "none") == 4 * sum(
        t.n_values for t in read_header(tiny).tensors)


def test_a_model_that_will_not_fit_is_refused_before_loading(kquant_file, monkeypatch):
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 3 * 2**20)
    monkeypatch.setattr("worker.model.loader.load_weights",
                        lambda *a, **k: pytest.fail("refused before the weights load"))
    weights = model_memory_bytes(kquant_file, "gguf")
    with pytest.raises(ModelTooLarge) as info:
        load_model_runner(kquant_file, quantization="auto", dtype="float32", kv_cache_bytes=8 * 2**20)
    message = str(info.value)
    assert message == (f"llama.gguf: will not fit in memory: about {(weights + 8 * 2**20) / 2**20:.0f} MiB needed "
                       f"({weights / 2**20:.0f} MiB of weights under --quantization gguf, 8 MiB of KV cache) but "
                       "3 MiB free (MemAvailable and cgroup limits); a smaller model, quantization or --kv-cache-mib")


def test_a_model_that_fits_loads(kquant_file, monkeypatch):
    import inflight_kernels

    if not inflight_kernels.cpu_kernels_available():
        pytest.skip("CPU kernels not built")
    monkeypatch.setattr(host_memory, "available_bytes", lambda: model_memory_bytes(kquant_file, "gguf") + 2**20)
    runner = load_model_runner(kquant_file, quantization="auto", dtype="float32", kv_cache_bytes=2**20 - 1)
    assert runner.num_blocks > 0


def _worker(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """``inflight worker`` in its own process, with its health ports off and an unreachable Redis."""
    code = (f"{prelude}\nimport sys\nfrom inflight.cli import main\n"
            f"sys.exit(main(['worker', *sys.argv[1:]]))")
    return subprocess.run([sys.executable, "-c", code, "--device", "cpu", "--health-port", "0",
                           "--grpc-health-port", "0", "--redis-url", "redis://127.0.0.1:1/0", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_worker_command_refuses_a_truncated_file_in_one_line(kquant_file, tmp_path):
    size = kquant_file.stat().st_size
    path = cut(kquant_file, tmp_path, size - 2000)  # into the last two tensors, blk.1's float32 norms
    proc = _worker("--model", str(path))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"inflight worker: llama.gguf: truncated: the file is {size - 2000} bytes but its tensor data "
                     f"runs to byte {size} (2000 missing; tensor 'blk.1.attn_norm.weight' and 1 more past the end)"], \
        proc.stderr


def test_the_worker_command_refuses_a_model_that_will_not_fit_in_one_line(tmp_path):
    from common.model_files import default_model_path

    prelude = "import worker.model.host_memory as h\nh.available_bytes = lambda *a: 64 * 2**20"
    proc = _worker("--kv-cache-mib", "16", prelude=prelude)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"inflight worker: {default_model_path().name}: will not fit in memory: about ") and \
        " MiB of KV cache) but 64 MiB free " in last, proc.stderr
    assert ", 16 MiB of KV cache" in last


def test_the_worker_command_checks_the_file_before_an_explicit_dense_count_reads_it(kquant_file, tmp_path,
                                                                                    monkeypatch, capsys):
    import worker.serve.main
    from inflight.cli import main

    monkeypatch.setattr(worker.serve.main, "run_worker", lambda settings: pytest.fail("the worker must not start"))
    path = cut(kquant_file, tmp_path, 100)  # the header cut: GGUFReader would fail with an IndexError
    assert main(["worker", "--device", "cpu", "--model", str(path), "--dense-weights-min-rows", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inflight worker: llama.gguf: truncated or corrupt header: ") and "Traceback" not in err
