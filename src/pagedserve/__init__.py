"""pagedserve: an LLM serving engine with PagedAttention, continuous batching and chunked prefill."""
from .engine.llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
