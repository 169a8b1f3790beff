import json

import pytest

from pagedserve.entrypoints.cli import main
from pagedserve.sim.kv_calc import GB, GIB, kv_size, waste


def test_llama_70b_8192_tokens():
    r = kv_size(80, 8, 128, 2, 8192)
    assert r.bytes_per_token == 327_680  # 320 KiB
    # BF16: 2.5 GiB (2.68 GB) per 8k sequence. The seed's "1.25 GB" is half of this: it is the
    # FP8 figure in GiB (or K without V).
    assert r.bytes_per_sequence == 5 * GIB // 2
    assert kv_size(80, 8, 128, 1, 8192).bytes_per_sequence / GIB == pytest.approx(1.25)


def test_gqa_16_layers_4_heads_256_dim():
    r = kv_size(16, 4, 256, 2, 8192)
    assert r.bytes_per_sequence == GIB // 2  # 0.5 GiB = 0.537 GB: the seed's "0.54" is GB
    assert r.bytes_per_sequence / GB == pytest.approx(0.537, abs=1e-3)


def test_memory_budget_counts_whole_tokens_and_sequences():
    r = kv_size(80, 8, 128, 2, 8192, memory_bytes=40 * GIB)
    assert r.tokens_that_fit == 40 * GIB // 327_680 == 131_072
    assert r.sequences_that_fit == 16


def test_waste_hand_computed_case():
    r = waste(2, mean=20, std=0, max_len=100, block_size=16)
    # two requests of 20 tokens: contiguous reserves 200 slots, paged 2 x 32
    assert (r.used_tokens, r.contiguous_reserved, r.paged_reserved) == (40, 200, 64)
    assert r.contiguous_waste == pytest.approx(0.8) and r.paged_waste == pytest.approx(24 / 64)


def test_seed_exercise_about_82_percent_contiguous_under_1_percent_paged():
    r = waste(1000, 1500, 600, 8192, 16, seed=0)
    assert r.contiguous_waste == pytest.approx(1 - 1500 / 8192, abs=0.01)
    assert r.paged_waste < 0.01


def test_kv_cli_json(capsys):
    assert main(["kv", "waste", "--requests", "1000", "--mean", "1500", "--std", "600", "--max-len", "8192",
                 "--block-size", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0.80 < out["contiguous_waste"] < 0.84 and out["paged_waste"] < 0.01
    assert main(["kv", "size", "--layers", "16", "--kv-heads", "4", "--head-dim", "256", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gib_per_sequence"] == pytest.approx(0.5)
    assert main(["kv", "size", "--model", "llama-3.3-70b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_token"] == 327_680


@pytest.mark.parametrize("args", [dict(num_requests=0, mean=10, std=1, max_len=100),
                                  dict(num_requests=5, mean=200, std=1, max_len=100)])
def test_waste_rejects_bad_input(args):
    with pytest.raises(ValueError):
        waste(**args)


def test_demand_paged_waste_is_page_granular_and_finer_than_blocks_for_smollm2():
    # 20 tokens x 768 B = 15,360 B: 4 pages of 4 KiB = 21.33 tokens' worth per stream.
    r = waste(2, mean=20, std=0, max_len=100, block_size=16, stream_bytes=768, page_size=4096)
    assert r.tokens_per_page == pytest.approx(16 / 3)
    assert r.demand_paged_reserved == pytest.approx(2 * 4 * 4096 / 768)
    assert r.demand_paged_waste == pytest.approx(1 - 40 / (2 * 4 * 4096 / 768))
    assert r.demand_paged_waste < r.paged_waste
    big = waste(1000, 1500, 600, 8192, 16, seed=0)
    assert big.demand_paged_waste < big.paged_waste / 2
    # With CUDA-VMM-sized 2 MiB pages the same lengths waste more than blocks do.
    assert waste(1000, 1500, 600, 8192, 16, seed=0, page_size=2 << 20).demand_paged_waste > big.paged_waste
