"""`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Adapters load and unload on the engine thread between steps, in order with the requests
sent before them: a request accepted before an unload is in the engine when the unload
runs, so the unload sees it and is refused (400) until it finishes. The served names
(served_models.py) change only once the engine has done the load or unload; a request
that passed the `model` check just before an unload gets the engine's 400.
"""
from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from pydantic import Field
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from ...engine.async_engine import AsyncEngine, EngineDeadError
from ...engine.llm_engine import LLMEngine
from ...engine.lora_registry import LoRAModule, UnknownLoRAError
from ...http.errors import APIError
from ...http.json_body import StrictModel, parse_body
from ...http.openapi import request_body, text_body_responses
from .served_models import ServedModels
from .serving import engine_error


class LoadLoRAAdapterRequest(StrictModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: str = Field(min_length=1)
    lora_path: str | None = None  # accepted as vLLM does; the name decides


def install_lora_routes(app: FastAPI, engine: AsyncEngine, models: ServedModels) -> list[type[StrictModel]]:
    """The run-time adapter routes (only on a server started with --enable-lora; the API-key
    middleware guards them like every route); returns their request models for the document."""

    @app.post("/v1/load_lora_adapter", openapi_extra=request_body(LoadLoRAAdapterRequest),
              responses=text_body_responses("Loaded.", {400: "A bad name, path or adapter; `param` says which.",
                                                        404: "The adapter names a model this server lacks."}))
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        req = parse_body(await request.body(), LoadLoRAAdapterRequest)
        if req.lora_name in models.base_names or req.lora_name in models.adapters:
            raise APIError(400, f"the name {req.lora_name!r} is already served", param="lora_name")
        module = await _on_engine(engine, lambda e: e.add_lora(req.lora_name, req.lora_path), "lora_path")
        models.adapters[module.name] = module
        return PlainTextResponse(f"Success: LoRA adapter '{module.name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=request_body(UnloadLoRAAdapterRequest),
              responses=text_body_responses("Unloaded.", {400: "The body is invalid.",
                                                          404: "No adapter of that name is loaded."}))
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        req = parse_body(await request.body(), UnloadLoRAAdapterRequest)
        if req.lora_name not in models.adapters:
            raise APIError(404, f"no LoRA adapter named {req.lora_name!r} is loaded", param="lora_name",
                           code="model_not_found")
        await _on_engine(engine, lambda e: e.remove_lora(req.lora_name), "lora_name")
        del models.adapters[req.lora_name]
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return [LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest]


async def _on_engine(engine: AsyncEngine, fn: Callable[[LLMEngine], LoRAModule], param: str) -> LoRAModule:
    try:
        return await engine.run_on_thread(fn)
    except UnknownLoRAError as e:
        raise APIError(404, str(e), param="lora_name", code="model_not_found") from None
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None
    except EngineDeadError as e:
        raise engine_error(e) from None

