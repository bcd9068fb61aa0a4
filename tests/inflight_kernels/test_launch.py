"""Launch configuration of the CUDA kernels (pure Python, runs on the CPU)."""

from __future__ import annotations

import pytest

from inflight_kernels.cuda import launch
from inflight_kernels.cuda.launch import DEFAULT_SMEM_BYTES, PARTITION_SIZE, plan_attention

H100_SMS, H100_OPT_IN = 132, 227 * 1024
A100_OPT_IN = 163 * 1024


def plan(num_seqs=8, num_heads=32, num_kv_heads=8, head_size=128, block_size=16, max_blocks=64,
         dtype_bytes=2, sms=H100_SMS, opt_in=H100_OPT_IN):
    return plan_attention(num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks,
                          dtype_bytes, sms, opt_in)


def test_smem_formula_matches_carve_up():
    # fp16, D=128, gqa 4: K+V tiles 2*32*128*2, fp32 q+acc 2*4*128, scores 4*32, m/l/alpha 3*4
    assert launch.attention_smem_bytes(128, 4, 2) == 16384 + 4 * (1024 + 128 + 12)


@pytest.mark.parametrize("head", [64, 96, 128])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_common_configs_fit_default_smem(head, gqa, dtype_bytes):
    assert launch.attention_smem_bytes(head, gqa, dtype_bytes) <= DEFAULT_SMEM_BYTES


def test_large_config_needs_opt_in_and_too_large_raises():
    big = plan(num_heads=64, num_kv_heads=8, head_size=256, dtype_bytes=4)  # gqa 8, fp32, D=256
    assert big.smem_bytes > DEFAULT_SMEM_BYTES and big.needs_opt_in
    assert not plan(head_size=128).needs_opt_in
    with pytest.raises(ValueError, match="opt-in limit"):
        plan(num_heads=512, num_kv_heads=1, head_size=256, dtype_bytes=4, opt_in=A100_OPT_IN)


def test_single_pass_grid_and_partition_cover_context():
    p = plan(num_seqs=256, num_kv_heads=8, max_blocks=40, block_size=16)  # 640 tokens, many blocks
    assert not p.split and p.num_partitions == 1
    assert p.grid == (8, 256, 1) and p.block == (launch.NUM_THREADS, 1, 1)
    assert p.partition_size >= 640 and p.partition_size % launch.TILE_TOKENS == 0


def test_split_grid_partitions_and_reduction():
    p = plan(num_seqs=1, num_heads=32, num_kv_heads=8, max_blocks=2048, block_size=16)  # 32k tokens
    assert p.split and p.num_partitions == 32768 // PARTITION_SIZE == 64
    assert p.grid == (8, 1, 64) and p.partition_size == PARTITION_SIZE
    assert p.reduce_grid == (32, 1, 1) and p.reduce_smem_bytes == 4 * 65


def test_num_partitions_rounds_up():
    assert launch.num_partitions(1) == 1
    assert launch.num_partitions(PARTITION_SIZE) == 1
    assert launch.num_partitions(PARTITION_SIZE + 1) == 2


def test_split_rule_boundaries():
    sms = 100
    # one partition never splits, whatever the grid size
    assert not launch.use_split_context(1, 1, PARTITION_SIZE, sms)
    # two partitions: split iff blocks < 2 waves of SMs
    assert launch.use_split_context(1, 199, PARTITION_SIZE + 1, sms)
    assert not launch.use_split_context(1, 200, PARTITION_SIZE + 1, sms)
    # a full grid splits only past the long-context threshold
    assert not launch.use_split_context(64, 8, launch.SPLIT_LONG_CONTEXT, sms)
    assert launch.use_split_context(64, 8, launch.SPLIT_LONG_CONTEXT + 1, sms)


def test_bad_gqa_and_grid_limits_raise():
    with pytest.raises(ValueError, match="multiple"):
        plan(num_heads=30, num_kv_heads=8)
    with pytest.raises(ValueError, match="grid"):
        plan(num_seqs=70000)


def test_reshape_and_cache_plan():
    assert launch.plan_reshape_and_cache(5) == ((5, 1, 1), (launch.NUM_THREADS, 1, 1))
    with pytest.raises(ValueError):
        launch.plan_reshape_and_cache(2**31)


def test_byte_formulas():
    # 2 seqs of 10 and 30 tokens, 4 heads / 2 kv heads, D=64, fp16
    kv = 2 * 40 * 2 * 64 * 2
    qo = 2 * 2 * 4 * 64 * 2
    assert launch.attention_bytes([10, 30], 4, 2, 64, 2) == kv + qo
    assert launch.attention_bytes([10, 30], 4, 2, 64, 2, partitions=3) == kv + qo + 2 * 2 * 4 * 3 * 66 * 4
    assert launch.cache_write_bytes(3, 2, 64, 2) == 4 * 3 * 2 * 64 * 2 + 24
