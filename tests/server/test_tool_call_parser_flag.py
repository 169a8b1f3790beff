"""`--tool-call-parser` picks the parser (hermes by default); `none` turns tool calling
off, and requests with tools then get a 400 that says how to turn it on."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.openai.args import server_config_from_args
from pagedserve.entrypoints.openai.server import build_app
from pagedserve.model.loader import load_model

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


def config(*flags: str):
    return server_config_from_args(build_parser().parse_args(["serve", "--kv-cache-memory", "16MiB", *flags]))


def test_the_flag_chooses_the_parser():
    assert config().tool_call_parser == "hermes"
    assert config("--tool-call-parser", "hermes").tool_call_parser == "hermes"
    assert config("--tool-call-parser", "none").tool_call_parser is None
    with pytest.raises(SystemExit):
        config("--tool-call-parser", "mistral")


def test_without_a_parser_tools_are_a_400():
    cfg = config("--tool-call-parser", "none")
    app = build_app(LLMEngine(cfg.engine, loaded=load_model()), cfg)

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Add 2."}], "tools": TOOLS, "max_tokens": 4})

    r = asyncio.run(post())
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "tools" and "--tool-call-parser" in error["message"]
