"""``inflight bench <name>``: every benchmark entry point is a subcommand of one command,
running the module's own ``main`` with the rest of the line; the bare command is still the
batching comparison and ``soak`` still the soak harness."""

import ast
from pathlib import Path

import pytest

from bench import subcommands
from inflight.cli import main as inflight_main

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _entry_points() -> set[str]:
    """Modules directly under bench/ with a top-level ``main`` and a ``__main__`` block."""
    found = set()
    for path in BENCH.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        has_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
        if has_main and "__main__" in path.read_text(encoding="utf-8") and path.stem != "cli":
            found.add(f"bench.{path.stem}")
    return found


def test_every_entry_point_is_a_subcommand_named_after_its_module():
    assert set(subcommands.SUBCOMMANDS.values()) == _entry_points()
    assert all(name == module.removeprefix("bench.").replace("_", "-")
               for name, module in subcommands.SUBCOMMANDS.items())


def test_list_names_each_subcommand_with_its_first_sentence(capsys):
    assert inflight_main(["bench", "list"]) == 0
    out = capsys.readouterr().out
    assert "inflight bench spec-decode  " in out and "Speculative decoding with n-gram drafts" in out
    assert len(out.splitlines()) == 1 + len(subcommands.SUBCOMMANDS)


def test_a_subcommand_is_the_module_with_the_same_options(capsys, monkeypatch):
    with pytest.raises(SystemExit) as done:
        inflight_main(["bench", "parallel-sampling", "--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out
    assert "--prompt-tokens" in usage and "--batching" not in usage  # the module's own parser answered
    seen = []
    monkeypatch.setattr("bench.sampler.main", lambda argv: seen.append(argv))
    assert inflight_main(["bench", "sampler", "--steps", "3"]) == 0  # None from main is success
    assert seen == [["--steps", "3"]]


def test_the_bare_command_is_still_the_batching_comparison(capsys):
    with pytest.raises(SystemExit) as done:
        inflight_main(["bench", "--help"])
    assert done.value.code == 0
    assert "--batching" in capsys.readouterr().out


def test_results_folder_option_is_declared_once():
    """``--out`` (a run's folder) comes from bench/options.py, whose default is bench/results
    wherever the command starts; no module keeps a cwd-relative ``Path("bench/results")``."""
    from bench.options import RESULTS_DIR

    assert RESULTS_DIR == BENCH / "results" and RESULTS_DIR.is_dir()
    relative = [p.name for p in BENCH.rglob("*.py") if 'Path("bench/results")' in p.read_text(encoding="utf-8")]
    assert relative == []
    users = {p.stem for p in BENCH.glob("*.py") if "add_out_option(" in p.read_text(encoding="utf-8")}
    assert users >= {"cli", "soak", "sampler", "spec_decode", "structured_outputs", "parallel_sampling"}
