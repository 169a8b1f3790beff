from pagedserve.core.kv_plan import DraftKV, plan_kv_cache
from pagedserve.sim.cost_model import CostModel
from pagedserve.sim.hardware import get_hardware
from pagedserve.sim.memory import plan_memory
from pagedserve.sim.models import MODELS


def test_the_memory_plan_sets_a_drafts_scratch_aside_as_the_engine_does():
    cost = CostModel(MODELS["llama-3.1-8b"], get_hardware("h100-sxm5"), "bf16")
    memory = 2**32
    draft = DraftKV(cost.kv_bytes_per_token / 4, own_cache=False, num_seqs=32, num_speculative_tokens=4)
    plain = plan_memory(cost, 16, 256, 32, kv_cache_memory=memory)
    drafted = plan_memory(cost, 16, 256, 32, kv_cache_memory=memory, draft=draft)
    assert plain.num_blocks == plan_kv_cache(memory, 16, cost.kv_bytes_per_token).num_blocks
    assert drafted.num_blocks == plan_kv_cache(memory, 16, cost.kv_bytes_per_token, draft).num_blocks
    assert drafted.num_blocks < plain.num_blocks
