"""POST /tokenize and /detokenize, vLLM's: a prompt or a conversation to token ids, and back."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from ...http.errors import APIError
from ...http.json_body import parse_body
from ...http.openai_bodies import DetokenizeRequest, TokenizeRequest, check_token_ids
from ...http.tools import template_messages
from .serving_chat import ChatServing


class TokenizeServing(ChatServing):
    """A ChatServing, so that conversations tokenise exactly as /v1/chat/completions renders them."""

    async def tokenize(self, request: Request) -> JSONResponse:
        req = parse_body(await request.body(), TokenizeRequest)
        self.resolve_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.prompt is not None:
            tokens = await self.off_loop(self.tokenizer.encode, req.prompt, req.add_special_tokens)
            count = len(tokens)
        else:
            # `count` includes the images' tokens; `tokens` holds each image's placeholder once.
            images = await self.load_images(req.messages, req.model)
            text, tokens = await self.off_loop(self.render_prompt, template_messages(req.messages),
                                               req.add_generation_prompt)
            count = self.images.prompt_tokens(text, tokens, images)
        return JSONResponse({"count": count, "max_model_len": self.engine.max_context_len, "tokens": tokens})

    async def detokenize(self, request: Request) -> JSONResponse:
        req = parse_body(await request.body(), DetokenizeRequest)
        self.resolve_model(req.model)
        check_token_ids(req.tokens, self.engine.vocab_size, "tokens")
        return JSONResponse({"prompt": await self.off_loop(self.tokenizer.decode, req.tokens)})
