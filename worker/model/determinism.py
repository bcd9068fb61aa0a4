"""``--deterministic``: refuse to serve unless every op of the step is batch-invariant.

Batch-invariant means a row's result does not depend on the other rows of the
step, on how its prompt was split into chunks, or on whether its prefix came
from the prefix cache: a request's greedy text (and its logprobs, bit for bit)
is then the same whatever else the server is doing (SGLang's
``--enable-deterministic-inference``, vLLM's batch-invariant mode; the cause of
run-to-run drift is batch-size-dependent reductions, He et al., Thinking
Machines, "Defeating Nondeterminism in LLM Inference", 2025).

On the CPU the default path already has that property when, and only when, the
following hold (docs/DETERMINISTIC.md lists each op and its evidence):

* the compiled CPU kernels serve attention (each (row, kv head) on one thread,
  no split of the context, prefill rows through the decode kernel) and the
  layer ops (row-wise); the torch fallbacks pad to the batch's longest context
  or plan per batch, so their sums depend on the batch;
* every projection is prepacked for oneDNN (one row run as two, see
  :func:`worker.model.linear._one_row`) or q8_0 (fixed block order). Plain
  ``F.linear`` (float16 compute, or a CPU without oneDNN bf16) goes to MKL or
  another kernel chosen by the row count.

The check costs nothing per step: it only decides whether to start. CUDA is
refused: cuBLAS picks its GEMM algorithm and split-K by the row count and the
decode kernel splits long contexts by occupancy (docs/DETERMINISTIC.md).
"""

from __future__ import annotations

import torch

import inflight_kernels


def batch_invariance_problems(runner) -> list[str]:
    """What would make the step's results depend on batch composition.

    Args:
        runner: a :class:`worker.model.model_runner.ModelRunner` (its ``model``'s ``device``,
            ``dtype`` and ``packed``, ``config.head_dim``, ``cache.spec.dtype`` are read).

    Returns:
        One line per problem; empty when the step is batch-invariant.
    """
    model, head_dim, cache_dtype = runner.model, runner.config.head_dim, runner.cache.spec.dtype
    if model.device.type != "cpu":
        return [f"device {model.device.type}: batch-invariant GEMMs and attention exist only on the CPU here "
                "(cuBLAS chooses algorithms by batch size)"]
    problems = []
    if not inflight_kernels.cpu_kernels_available():
        problems.append("the compiled CPU kernels are not loaded (no g++, a failed build, or "
                        "INFLIGHT_CPU_KERNELS=0): the torch attention fallbacks depend on the batch")
    else:
        problems += inflight_kernels.compiled_step_gaps(head_dim, model.dtype, cache_dtype)
    if not model.packed:
        problems.append(f"projections in {str(model.dtype).removeprefix('torch.')} are not prepacked for oneDNN "
                        "on this CPU (plain F.linear picks its kernel by row count): use --dtype float32, "
                        "bfloat16 on a CPU with AVX-512 BF16 and no AMX, or --quantization gguf, q8_0 or q4_1")
    elif _onednn_amx_bf16(model):
        problems.append("bfloat16 projections on a CPU with AMX run oneDNN's AMX kernels, whose blocking changes "
                        "past 32 rows for some shapes (SmolLM2-135M's o_proj and lm_head: row 0 of 33..70 rows "
                        "differed from the same row alone): use --dtype float32 or --quantization gguf")
    if getattr(model, "dense_min_rows", 0):
        problems.append(f"--dense-weights-min-rows {model.dense_min_rows}: steps of that many rows multiply "
                        "bfloat16-rounded copies of the weights, fewer rows the exact blocks, so a row's result "
                        "depends on its step's row count: leave it at 0")
    return problems


def _onednn_amx_bf16(model) -> bool:
    """bfloat16 projections left to oneDNN on a CPU with AMX tiles (no :class:`BF16Weight`
    of our own there: :func:`worker.model.linear.uses_bf16_kernel`)."""
    from worker.model.dtype import cpu_has_amx
    from worker.model.linear import BF16Weight

    return (model.dtype == torch.bfloat16 and cpu_has_amx()
            and not isinstance(model.layers[0].o, BF16Weight) if model.layers else False)


def require_batch_invariance(runner) -> None:
    """Raise unless :func:`batch_invariance_problems` finds none for ``runner``.

    Raises:
        ValueError: naming every problem found, one per line.
    """
    problems = batch_invariance_problems(runner)
    if problems:
        raise ValueError("--deterministic cannot be honoured here:\n  " + "\n  ".join(problems))
