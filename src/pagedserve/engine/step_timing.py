"""The step-time model a latency target budgets with (core/step_budget.py), for the
model being served on this machine.

`pagedserve sim calibrate` measures this CPU's primitives at the embedded model's
shapes and stores the fitted StepTimeModel beside them; the engine uses it when the
model it serves has those shapes. Otherwise it starts from a prior priced from the
model's shape at deliberately modest CPU rates: the scheduler's running correction
(StepTimeCorrection, up to 4x either way) then moves it to the machine's real speed
within tens of steps.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

from ..core.step_budget import StepTimeModel
from ..model.config import ModelConfig
from ..paths import calibration_path

logger = logging.getLogger(__name__)

# The prior's rates: fp32 GEMMs on two AVX2 cores reach 60-170 GFLOP/s at prefill sizes,
# decode-shaped reads 7-19 GB/s; the low ends keep a first budget on the small side.
PRIOR_LINEAR_FLOPS = 60e9
PRIOR_HEAD_FLOPS = 30e9
PRIOR_ATTENTION_FLOPS = 15e9
PRIOR_WEIGHT_BANDWIDTH = 15e9
PRIOR_KV_BANDWIDTH = 5e9
PRIOR_LAYER_CALL_S = 1e-4


def model_shape(config: ModelConfig) -> list[int]:
    """What a calibrated StepTimeModel is only valid for."""
    return [config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
            config.num_kv_heads, config.head_dim, config.vocab_size]


def calibration_entry(model: StepTimeModel, config: ModelConfig) -> dict:
    """How `sim calibrate` stores the fitted model in its calibration file."""
    return {"model_shape": model_shape(config), **asdict(model)}


def prior_step_time_model(config: ModelConfig) -> StepTimeModel:
    head = config.vocab_size * config.hidden_size
    body = config.num_params - head
    return StepTimeModel(
        fixed_s=4 * body / PRIOR_WEIGHT_BANDWIDTH + config.num_layers * PRIOR_LAYER_CALL_S,
        per_token_s=2 * body / PRIOR_LINEAR_FLOPS,
        per_sample_s=2 * head / PRIOR_HEAD_FLOPS,
        per_context_token_s=config.kv_bytes_per_token() / PRIOR_KV_BANDWIDTH,
        per_pair_s=4 * config.num_layers * config.num_heads * config.head_dim / PRIOR_ATTENTION_FLOPS,
    )


def step_time_model(config: ModelConfig, path: Path | None = None) -> tuple[StepTimeModel, str]:
    """(the model, where it came from) for serving `config` here."""
    path = path or calibration_path()
    try:
        entry = json.loads(path.read_text()).get("step_time_model")
    except (OSError, ValueError, AttributeError):
        entry = None
    if isinstance(entry, dict) and entry.get("model_shape") == model_shape(config):
        try:
            return StepTimeModel(**{k: v for k, v in entry.items() if k != "model_shape"}), f"calibrated ({path})"
        except (TypeError, ValueError) as e:
            logger.warning("ignoring the step-time model in %s: %s", path, e)
    return prior_step_time_model(config), "a prior from the model's shape, corrected online"
