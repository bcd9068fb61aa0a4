"""bench/ceiling.py counts a decoder's parameters and weight bytes as held:
prepacked float32 or Q8_0-quantized."""

import torch

from bench import ceiling
from bench.ceiling import count_params, weight_bytes
from worker.model.model_runner import tiny_random_runner


def test_quantized_weights_count_the_same_parameters_and_their_own_bytes():
    plain = tiny_random_runner(seed=0)  # hidden 64, 2 layers, qkv 128 rows, inter 128, vocab 256, untied head
    q8 = tiny_random_runner(seed=0, quantization="q8_0")
    projections = 2 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128)
    norms, table = 2 * 2 * 64 + 64, 256 * 64
    assert count_params(plain.model) == count_params(q8.model) == projections + norms + 2 * table
    # a step reads every weight but the embedding: float32, or int8 plus a float32 scale and an int32
    # compensation per 32 (1.25 bytes)
    assert weight_bytes(plain.model) == 4 * (projections + norms + table)
    assert weight_bytes(q8.model) == 1.25 * (projections + table) + 4 * norms


def test_q8_0_is_bounded_by_an_int8_product():
    """q8_0's GEMMs multiply int8 by int8, so its ceiling is an int8 product's (torch._int_mm),
    not the float compute dtype's; the int8 probe runs and counts 2 n^3 operations."""
    assert ceiling.matmul_dtype(torch.float32, "q8_0") == torch.int8
    assert ceiling.matmul_dtype(torch.bfloat16, "none") == torch.bfloat16
    assert ceiling.measure_matmul_flops(torch.int8, n=64, repeats=1) > 0
