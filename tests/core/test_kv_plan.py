"""KV sizing: the pool beside a draft model's cache and scratch, as the engine and the
simulator both compute it."""
from __future__ import annotations

from pagedserve.core.kv_plan import DraftKV, plan_kv_cache, scratch_blocks_per_seq

BLOCK = 16
KV_PER_TOKEN = 1000  # bytes, target


def test_without_a_draft_the_pool_is_memory_over_block_bytes():
    plan = plan_kv_cache(100 * BLOCK * KV_PER_TOKEN + 5, BLOCK, KV_PER_TOKEN)
    assert (plan.num_blocks, plan.num_scratch_blocks, plan.scratch_bytes) == (100, 0, 0)
    assert plan.bytes_per_block == BLOCK * KV_PER_TOKEN


def test_scratch_covers_any_k_positions_of_every_drafting_sequence():
    assert scratch_blocks_per_seq(16, 1) == 1
    assert scratch_blocks_per_seq(16, 2) == 2  # p may be a block's last slot
    assert scratch_blocks_per_seq(16, 17) == 2
    assert scratch_blocks_per_seq(16, 18) == 3


def test_a_self_draft_shares_the_pool_and_pays_only_for_scratch():
    draft = DraftKV(KV_PER_TOKEN // 4, own_cache=False, num_seqs=8, num_speculative_tokens=4)
    plan = plan_kv_cache(100 * BLOCK * KV_PER_TOKEN, BLOCK, KV_PER_TOKEN, draft)
    assert plan.bytes_per_block == BLOCK * KV_PER_TOKEN
    assert plan.num_scratch_blocks == 8 * 2
    assert plan.scratch_bytes == 16 * BLOCK * KV_PER_TOKEN // 4
    assert plan.num_blocks == 96  # 100 blocks' bytes less 16 quarter-size scratch blocks


def test_a_separate_draft_keeps_a_cache_beside_every_pool_block():
    draft = DraftKV(KV_PER_TOKEN, own_cache=True, num_seqs=1, num_speculative_tokens=1)
    plan = plan_kv_cache(100 * BLOCK * KV_PER_TOKEN, BLOCK, KV_PER_TOKEN, draft)
    assert plan.bytes_per_block == 2 * BLOCK * KV_PER_TOKEN
    assert (plan.num_scratch_blocks, plan.num_blocks) == (1, 49)


def test_memory_below_the_scratch_leaves_no_blocks():
    draft = DraftKV(KV_PER_TOKEN, own_cache=False, num_seqs=64, num_speculative_tokens=16)
    assert plan_kv_cache(BLOCK * KV_PER_TOKEN, BLOCK, KV_PER_TOKEN, draft).num_blocks == 0
