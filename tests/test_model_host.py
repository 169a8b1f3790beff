"""The multi-model server's state machine (entrypoints/openai/model_host.py) with engines
that build instantly: a model with a request in flight is never unloaded, concurrent
first requests load once, a failed load marks its model failed, sleep level 1 keeps the
weights the wake-up reuses. tests/server/test_server_models.py runs real models."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from fastapi import FastAPI

from pagedserve.engine_config import EngineConfig
from pagedserve.entrypoints.openai import model_host
from pagedserve.entrypoints.openai.args import ServerConfig
from pagedserve.entrypoints.openai.model_host import ModelHost
from pagedserve.entrypoints.openai.models_config import model_specs
from pagedserve.http.errors import APIError


class _Engine:
    """Stands in for LLMEngine: records what it was built from; a path named "bad" fails."""

    built: list[tuple[str, object]] = []

    def __init__(self, config: EngineConfig, loaded: object = None):
        if config.model == "bad":
            raise RuntimeError("no weights")
        self.loaded = loaded if loaded is not None else object()
        _Engine.built.append((config.model, loaded))


def _app(engine: _Engine, config: ServerConfig) -> FastAPI:
    app = FastAPI()
    app.state.engine = SimpleNamespace(engine=engine, max_context_len=128)
    return app


@pytest.fixture
def host(monkeypatch) -> ModelHost:
    monkeypatch.setattr(model_host, "LLMEngine", _Engine)
    _Engine.built = []
    config = ServerConfig(models={"a": "a", "b": "b", "bad": "bad"}, max_loaded_models=1)
    return ModelHost(config, model_specs(config.models, None, None, config.engine), _app)


def test_a_model_with_a_request_in_flight_is_never_unloaded(host):
    async def run() -> None:
        a, b = host.resolve("a"), host.resolve("b")
        await host.acquire(a)
        with pytest.raises(APIError) as e:
            await host.acquire(b)
        assert e.value.status == 503 and e.value.headers == {"Retry-After": "2"} and a.state == "loaded"
        host.release(a)
        await host.acquire(b)
        assert (a.state, b.state) == ("unloaded", "loaded")

    asyncio.run(run())


def test_concurrent_first_requests_load_once(host):
    async def run() -> None:
        b = host.resolve("b")
        apps = await asyncio.gather(*(host.acquire(b) for _ in range(5)))
        assert len({id(app) for app in apps}) == 1 and b.in_flight == 5 and b.loads == 1
        assert [path for path, _ in _Engine.built] == ["b"]

    asyncio.run(run())


def test_a_failed_load_marks_the_model_and_the_others_serve(host):
    async def run() -> None:
        with pytest.raises(APIError) as e:
            await host.acquire(host.resolve("bad"))
        assert e.value.status == 503 and "no weights" in e.value.message
        assert host.resolve("bad").card() == {"state": "failed", "reason": "RuntimeError: no weights"}
        await host.acquire(host.resolve("a"))

    asyncio.run(run())


def test_a_crashed_engine_marks_its_model_failed(host):
    async def run() -> None:
        a = host.resolve("a")
        await host.acquire(a)
        host.release(a)
        a.app.state.engine.on_crash(RuntimeError("boom"))
        with pytest.raises(APIError) as e:
            await host.acquire(a)
        assert e.value.status == 503 and "the engine crashed: RuntimeError: boom" in e.value.message
        for _ in range(100):  # the stop the crash scheduled
            if a.lifespan is None and a.state == "failed":
                break
            await asyncio.sleep(0.01)
        assert a.app is None and a.card()["state"] == "failed"
        await host.acquire(host.resolve("b"))

    asyncio.run(run())


def test_sleep_level_1_keeps_the_weights_the_wake_up_reuses(host):
    async def run() -> None:
        a = host.resolve("a")
        await host.acquire(a)
        weights = a.engine.loaded
        with pytest.raises(APIError) as e:
            await host.sleep(a, 1)
        assert e.value.status == 409
        host.release(a)
        await host.sleep(a, 1)
        assert a.card() == {"state": "sleeping", "sleep_level": 1} and a.app is None
        await host.wake_up(a)
        assert a.state == "loaded" and _Engine.built[-1] == ("a", weights)
        await host.sleep(a, 2)
        await host.wake_up(a)
        assert _Engine.built[-1] == ("a", None)  # level 2 dropped the weights: loaded again

    asyncio.run(run())


def test_several_models_refuse_the_single_model_flags():
    with pytest.raises(ValueError, match="served_model_name does not go with several models"):
        ServerConfig(models={"a": "a"}, served_model_name=["x"])
    with pytest.raises(ValueError, match="max_loaded_models needs several models"):
        ServerConfig(max_loaded_models=2)


def test_the_model_flag_takes_a_path_or_repeated_name_path_pairs(tmp_path):
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.entrypoints.openai.args import server_config_from_args

    parser = build_parser()
    config = server_config_from_args(parser.parse_args(["serve", "--model", "a=/x.gguf", "--model", "b=/y"]))
    assert config.models == {"a": "/x.gguf", "b": "/y"} and config.engine.model is None and config.multi_model
    odd = tmp_path / "with=sign.gguf"  # an existing path is a path, "=" or not
    odd.write_bytes(b"")
    assert server_config_from_args(parser.parse_args(["serve", "--model", str(odd)])).engine.model == str(odd)
    with pytest.raises(ValueError, match="given twice"):
        server_config_from_args(parser.parse_args(["serve", "--model", "a=/x", "--model", "a=/y"]))


def test_a_models_config_gives_aliases_and_engine_options(tmp_path, monkeypatch):
    monkeypatch.setattr(model_host, "LLMEngine", _Engine)
    (tmp_path / "dir" / "d").mkdir(parents=True)
    (tmp_path / "dir" / "d" / "config.json").write_text("{}")
    (tmp_path / "dir" / "e.gguf").write_bytes(b"")
    file = tmp_path / "models.yaml"
    file.write_text("models:\n  c:\n    path: /c\n    aliases: [sea, see]\n    options: {max_model_len: 64}\n")
    base = EngineConfig(max_model_len=256)
    specs = model_specs({"a": "/a"}, str(tmp_path / "dir"), str(file), base)
    assert list(specs) == ["a", "d", "e", "c"] and specs["d"].path == str(tmp_path / "dir" / "d")
    assert specs["c"].engine_config(base).max_model_len == 64 and specs["a"].engine_config(base).max_model_len == 256
    host = ModelHost(ServerConfig(models={"a": "/a"}), specs, _app)
    assert host.resolve("see") is host.resolve("c") and host.resolve("c").card() == {"state": "unloaded",
                                                                                        "aliases": ["sea", "see"]}
    for text, message in [("models:\n  c: {path: /c, options: {kv_cache_memory: lots}}\n", "model 'c'.*lots"),
                          ("models:\n  c: {path: /c, options: {warp: 9}}\n", "model 'c'.*warp"),
                          ("models:\n  a: {path: /c}\n", "'a' is given twice"),
                          ("models:\n  c: {path: /c, aliases: [a]}\n", "'a' is given twice"),
                          ("models:\n  c: {path: /c, size: 3}\n", "unknown keys \\['size'\\]"),
                          ("models: []\n", "non-empty 'models' mapping")]:
        file.write_text(text)
        with pytest.raises(ValueError, match=message):
            model_specs({"a": "/a"}, None, str(file), base)
