"""The bodies of POST /v1/embeddings (OpenAI's), /v1/score (vLLM's) and /v1/rerank
(Jina's and Cohere's), and the shapes they answer, for the parser and the OpenAPI
document alike (as openai_bodies.py). Checks that need the model (token ids, the
context length, `dimensions` against the embedding size) are the server's
(entrypoints/openai/serving_pooling.py)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, WithJsonSchema

from .json_body import StrictModel
from .openai_bodies import PROMPT_FORMS

_Text = Annotated[str, Field(min_length=1)]
_Texts = Annotated[list[_Text], Field(min_length=1)]
_INPUT_SCHEMA = {
    "description": "A string, a list of strings, a list of token ids, or a list of token-id lists; each input "
                   "non-empty, token ids below the vocabulary size, within the context length, at most "
                   "--max-queued-requests inputs.",
    "anyOf": PROMPT_FORMS,
}


class PoolingBody(StrictModel):
    model: str | None = Field(None, description="One of the names /v1/models lists; default: the first.")
    priority: int = Field(0, description="Lower runs first under --scheduling-policy priority.")


class EmbeddingRequest(PoolingBody):
    # Checked by completion_prompts(input, "input"), whose messages say which form was wrong.
    input: Annotated[Any, WithJsonSchema(_INPUT_SCHEMA)]
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector's little-endian float32 bytes, as OpenAI's.")
    dimensions: Annotated[int, Field(ge=1, description="Keep the first dimensions components, then "
                                                       "renormalise (at most the model's embedding size).")] | None = None
    normalize: bool = Field(True, description="L2-normalise each vector (vLLM's extra).")
    user: str | None = None  # OpenAI's; accepted, unused


class ScoreRequest(PoolingBody):
    """vLLM's: one text_1 against each text_2, or two lists of equal length pairwise."""

    text_1: _Text | _Texts
    text_2: _Text | _Texts


class RerankRequest(PoolingBody):
    query: _Text
    documents: _Texts
    top_n: Annotated[int, Field(ge=0, description="The best top_n results; 0 or absent: all.")] | None = None
    return_documents: bool = True


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreData(BaseModel):
    object: Literal["score"]
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
