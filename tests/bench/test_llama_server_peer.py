"""The llama-server peer's process handling, without a llama.cpp binary (CI has none).

The runner against a real binary is checked by hand (bench/README.md, "llama-server peer").
"""

from pathlib import Path

import pytest

from bench.peers.llama_server import LlamaServerSettings, serve


def test_serve_reports_a_server_that_exits_with_its_log(tmp_path):
    script = tmp_path / "llama-server"
    script.write_text("#!/bin/sh\necho 'error: model file not found' >&2\nexit 3\n")
    script.chmod(0o755)
    log = tmp_path / "logs" / "llama-server.log"  # parent made by serve
    settings = LlamaServerSettings(script, Path("missing.gguf"), parallel=2, log=log)
    with pytest.raises(RuntimeError, match=r"exited with 3[\s\S]*model file not found"):
        with serve(settings, ready_timeout_s=30):
            pass
