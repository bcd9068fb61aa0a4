"""The subcommands of ``inflight bench``: each benchmark entry point under one command.

``inflight bench <name> [options]`` runs ``python -m bench.<module> [options]`` in this
process (same options, same output); ``inflight bench [options]`` without a name is the
batching comparison of :mod:`bench.cli`, as before. The names are the module names with
hyphens (``spec-decode`` for ``bench/spec_decode.py``), as ``vllm bench`` names its
subcommands; ``inflight bench list`` prints them with their first docstring line.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

#: subcommand -> module under bench/ whose ``main(argv) -> int | None`` it runs.
SUBCOMMANDS: dict[str, str] = {
    "activation-rounding": "bench.activation_rounding",
    "attention-memory": "bench.attention_memory",
    "chaos": "bench.chaos",
    "contention": "bench.contention",
    "decode-attention": "bench.decode_attention",
    "fixed-cost": "bench.fixed_cost",
    "gpu-engine": "bench.gpu_engine",
    "gpu-kernels": "bench.gpu_kernels",
    "kquant-products": "bench.kquant_products",
    "kv-routing": "bench.kv_routing",
    "litellm-check": "bench.litellm_check",
    "lora": "bench.lora",
    "openmp-teams": "bench.openmp_teams",
    "padded-model": "bench.padded_model",
    "parallel-sampling": "bench.parallel_sampling",
    "prefill-pause": "bench.prefill_pause",
    "profile-step": "bench.profile_step",
    "quant-accuracy": "bench.quant_accuracy",
    "real-shapes": "bench.real_shapes",
    "sampler": "bench.sampler",
    "soak": "bench.soak",
    "spec-decode": "bench.spec_decode",
    "structured-outputs": "bench.structured_outputs",
    "two-models": "bench.two_models",
}


def summary(module: str) -> str:
    """The first sentence of ``module``'s docstring, read from its source (nothing is
    imported, so the list costs no torch import)."""
    path = Path(__file__).resolve().parent / f"{module.rsplit('.', 1)[1]}.py"
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    first = " ".join(doc.strip().split("\n\n")[0].split())  # the first paragraph, one line
    return first.split(". ")[0].rstrip(".") + "." if first else ""


def listing() -> str:
    """``inflight bench list``: one line per subcommand, name and first sentence."""
    width = max(map(len, SUBCOMMANDS))
    lines = ["inflight bench [options]            the batching comparison (bench/cli.py; --help)"]
    lines += [f"inflight bench {name:<{width}}  {summary(module)}" for name, module in SUBCOMMANDS.items()]
    return "\n".join(lines)


def run(name: str, argv: list[str]) -> int:
    """Run subcommand ``name`` with ``argv`` (its own options); returns its exit code
    (0 when its ``main`` returns None).

    Raises:
        KeyError: ``name`` is not a subcommand.
    """
    module = importlib.import_module(SUBCOMMANDS[name])
    code = module.main(argv)
    return 0 if code is None else int(code)
