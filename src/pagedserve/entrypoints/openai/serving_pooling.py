"""POST /v1/embeddings (OpenAI's), /v1/score (vLLM's) and /v1/rerank (Jina's and Cohere's)
on the generating engine: each input is a pooling request (LLMEngine.add_pooling_request)
scheduled beside generation. A score is the cosine similarity of the two texts'
embeddings (what vLLM scores with for an embedding model): the model has no
classification head, so there is no cross-encoder score to give.
"""
from __future__ import annotations

import base64
from collections.abc import Callable, Sequence

import numpy as np
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.async_engine import EngineDeadError, GenerationRequest, RequestStream
from ...http.disconnect import until_disconnected
from ...http.errors import APIError
from ...http.json_body import StrictModel
from ...http.openai_bodies import Prompt, check_token_ids, completion_prompts
from ...http.openapi import admitted_responses, post_route
from ...http.pooling_bodies import EmbeddingRequest, EmbeddingResponse, RerankRequest, RerankResponse, \
    ScoreRequest, ScoreResponse
from ...pooling_params import PoolingParams, cosine_similarity, score_pairs
from ...sampling_params import SamplingParams
from .protocol import check_prompt_chars
from .routes import ServerParts
from .serving import OpenAIServing, ResponseMeta, engine_error

# A pooling request never samples; GenerationRequest carries these unused params.
_NO_SAMPLING = SamplingParams(max_tokens=1)
Vectors = list[tuple[float, ...]]


def pooling_routes(app: FastAPI, parts: ServerParts) -> list[type[StrictModel]]:
    """The embedding routes; returns their request models for the document."""
    serving = PoolingServing(parts.context)

    post_route(app, "/v1/embeddings", EmbeddingRequest, admitted_responses(EmbeddingResponse), "create_embeddings",
               serving.embeddings)
    post_route(app, "/v1/score", ScoreRequest, admitted_responses(ScoreResponse), "create_score", serving.score)
    post_route(app, "/v1/rerank", RerankRequest, admitted_responses(RerankResponse), "create_rerank", serving.rerank)

    return [EmbeddingRequest, ScoreRequest, RerankRequest]


def encode_vector(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return list(vector)


class PoolingServing(OpenAIServing):
    async def embeddings(self, request: Request) -> Response:
        arrival, req, meta = await self.read_request(request, EmbeddingRequest, "embd")
        inputs = completion_prompts(req.input, "input")
        try:
            pooling = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
            pooling.validate_for_model(self.engine.engine.loaded.config.hidden_size)
        except ValueError as e:
            raise APIError(400, str(e), param="dimensions") from None

        def respond(vectors: Vectors, num_tokens: int) -> Response:
            data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
                    for i, v in enumerate(vectors)]
            return JSONResponse({"id": meta.id, "object": "list", "created": meta.created, "model": meta.model,
                                 "data": data, "usage": _usage(num_tokens)})

        return await self._pool(request, arrival, meta, inputs, pooling, req.priority, "input", respond)

    async def score(self, request: Request) -> Response:
        arrival, req, meta = await self.read_request(request, ScoreRequest, "score")
        try:
            pairs = score_pairs(req.text_1, req.text_2, lambda t: isinstance(t, str))
        except ValueError as e:
            raise APIError(400, str(e), param="text_1") from None
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once

        def respond(vectors: Vectors, num_tokens: int) -> Response:
            by_text = dict(zip(texts, vectors))
            data = [{"object": "score", "index": i, "score": cosine_similarity(by_text[a], by_text[b])}
                    for i, (a, b) in enumerate(pairs)]
            return JSONResponse({"id": meta.id, "object": "list", "created": meta.created, "model": meta.model,
                                 "data": data, "usage": _usage(num_tokens)})

        return await self._pool(request, arrival, meta, texts, PoolingParams(), req.priority, "text_1", respond)

    async def rerank(self, request: Request) -> Response:
        arrival, req, meta = await self.read_request(request, RerankRequest, "rerank")

        def respond(vectors: Vectors, num_tokens: int) -> Response:
            scores = [cosine_similarity(vectors[0], d) for d in vectors[1:]]
            order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
            results = [{"index": i, "relevance_score": scores[i],
                        **({"document": {"text": req.documents[i]}} if req.return_documents else {})} for i in order]
            return JSONResponse({"id": meta.id, "model": meta.model, "results": results,
                                 "usage": {"total_tokens": num_tokens}})

        return await self._pool(request, arrival, meta, [req.query, *req.documents], PoolingParams(), req.priority,
                                "documents", respond)

    async def _pool(self, request: Request, arrival: float, meta: ResponseMeta, inputs: Sequence[Prompt],
                    pooling: PoolingParams, priority: int, param: str,
                    respond: Callable[[Vectors, int], Response]) -> Response:
        """Embed `inputs` as one admitted group; `respond` makes the reply from their vectors
        (in order) and prompt token count."""
        try:
            self.engine.engine.check_task("embed")
        except ValueError as e:
            raise APIError(400, str(e), param="model", code="wrong_task") from None
        if len(inputs) > self.admission.max_queued_requests:
            raise APIError(400, f"{param} has {len(inputs)} inputs; this server takes at most "
                                f"{self.admission.max_queued_requests} per request", param=param)
        with self.admission.admit(len(inputs)) as seat:
            token_ids = await self.off_loop(self._tokenize, inputs, param)
            ids = [f"{meta.id}-{i}" for i in range(len(token_ids))]
            stream = await self.start(seat, [
                GenerationRequest(rid, tokens, _NO_SAMPLING, arrival, priority, lora_name=self.lora_of(meta.model),
                                  pooling=pooling) for rid, tokens in zip(ids, token_ids)])
            return await until_disconnected(request, self._gather(stream, ids, sum(map(len, token_ids)), respond))

    def _tokenize(self, inputs: Sequence[Prompt], param: str) -> list[list[int]]:
        """Each input's token ids, checked against the context; runs in the thread pool."""
        limit = self.engine.max_context_len
        out = []
        for i, prompt in enumerate(inputs):
            name = param if len(inputs) == 1 else f"{param}[{i}]"
            if isinstance(prompt, str):
                check_prompt_chars(prompt, self.limits, limit, name)
                tokens = self.tokenizer.encode(prompt) if prompt else []
            else:
                check_token_ids(prompt, self.engine.vocab_size, param)
                tokens = list(prompt)
            if not tokens:
                raise APIError(400, f"{name} must not be empty", param=param)
            if len(tokens) > limit:
                raise APIError(400, f"this model's maximum context length is {limit} tokens, but {name} has "
                                    f"{len(tokens)} tokens", param=param, code="context_length_exceeded")
            out.append(tokens)
        return out

    @staticmethod
    async def _gather(stream: RequestStream, ids: list[str], num_tokens: int,
                      respond: Callable[[Vectors, int], Response]) -> Response:
        vectors: dict[str, tuple[float, ...]] = {}
        try:
            async for delta in stream:
                if delta.embedding is not None:
                    vectors[delta.request_id] = delta.embedding
        except EngineDeadError as e:
            raise engine_error(e) from None
        if len(vectors) != len(ids):  # aborted: the server is shutting down
            raise APIError(503, "the server is shutting down", code="shutting_down")
        return respond([vectors[rid] for rid in ids], num_tokens)


def _usage(num_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
