"""The load generator against a trivial in-process streaming server (the client's own speed)
and against a real `pagedserve serve` process."""
from __future__ import annotations

import asyncio
import json

from aiohttp import web

from pagedserve.workload.datasets import random_dataset
from pagedserve.bench.serve import ServeConfig, run, summary
from pagedserve.entrypoints.cli import main
from tests.server.server_process import start_server

FAKE_TOKENS = 4


async def _fake_completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    n = body["max_tokens"]
    for i in range(n):
        await resp.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n".encode())
    usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}
    await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return resp


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "fake"}]})


async def _client_against_fake(num_prompts: int, max_concurrency: int):
    app = web.Application()
    app.router.add_post("/v1/completions", _fake_completions)
    app.router.add_get("/v1/models", _models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        cfg = ServeConfig(base_url=f"http://127.0.0.1:{port}", max_concurrency=max_concurrency)
        return await run(cfg, random_dataset(num_prompts, 16, FAKE_TOKENS, vocab_size=1000), use_tqdm=False)
    finally:
        await runner.cleanup()


def test_client_sustains_far_more_than_the_engine_serves():
    # Server and client share one event loop and two busy cores, so this bounds the client from below.
    outcomes, duration, peak = asyncio.run(_client_against_fake(600, max_concurrency=32))
    s = summary(outcomes, duration, peak, None, [50, 99])
    print(f"client: {s['request_throughput']:.0f} req/s, {s['output_throughput']:.0f} tok/s")
    assert s["failed_requests"] == 0
    assert s["total_output_tokens"] == 600 * FAKE_TOKENS
    assert peak == 32
    assert s["request_throughput"] > 200


def test_bench_serve_against_a_real_server(tmp_path, capsys):
    server = start_server(tmp_path)
    try:
        out = tmp_path / "result.json"
        rc = main(["bench", "serve", "--base-url", server.url, "--dataset-name", "random", "--num-prompts", "6",
                   "--input-len", "24", "--output-len", "4", "--range-ratio", "0", "--ignore-eos",
                   "--goodput", "ttft:60000", "--percentiles", "50,90,99", "--no-progress", "--out", str(out),
                   "--server-flags", "pagedserve serve --kv-cache-memory 64MiB"])
        chat_rc = main(["bench", "serve", "--base-url", server.url, "--endpoint", "/v1/chat/completions",
                        "--dataset-name", "random", "--num-prompts", "2", "--input-len", "12", "--output-len", "3",
                        "--range-ratio", "0", "--ignore-eos", "--no-progress", "--max-concurrency", "1",
                        "--out", str(tmp_path / "chat.json")])
    finally:
        server.stop()
    assert rc == 0 and chat_rc == 0
    text = capsys.readouterr().out
    assert "P90 TTFT (ms)" in text and "Goodput (tok/s)" in text
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["successful_requests"] == 6 and s["failed_requests"] == 0
    assert s["total_output_tokens"] == 24  # exact: prompts went as token ids, ignore_eos
    assert s["total_input_tokens"] == 6 * 24
    assert s["goodput_requests"] == 6
    assert all(r["output_tokens"] == 4 and r["chunk_times"] for r in result["requests"])
    # Enough to rerun and compare it: the commit, the CPU, the server's flags.
    from pagedserve.kernels import cpu_model_name

    env = result["environment"]
    assert env["cpu"] == cpu_model_name() and "avx2" in env["cpu_flags"]
    assert env["server_flags"] == "pagedserve serve --kv-cache-memory 64MiB"
    assert env["commit"] is None or len(env["commit"]) == 40
    chat = json.loads((tmp_path / "chat.json").read_text())["summary"]
    assert chat["successful_requests"] == 2 and chat["total_output_tokens"] == 6
    assert chat["peak_concurrency"] == 1


def test_spec_decode_acceptance_from_two_metrics_scrapes():
    """The counters as the server's Prometheus collector renders them, then the deltas."""
    from types import SimpleNamespace

    from pagedserve.bench.serve import parse_spec_decode_counters, spec_decode_delta
    from pagedserve.engine.async_engine import EngineSnapshot
    from pagedserve.entrypoints.openai.metrics import ServerMetrics
    from pagedserve.spec_decode.acceptance_stats import SpecDecodeStats

    def scrape(drafts: int, proposed: int, accepted: int, per_pos: list[int]) -> dict:
        metrics = ServerMetrics("m")
        spec = SpecDecodeStats(len(per_pos), drafts, proposed, accepted, per_pos)
        metrics.watch(SimpleNamespace(snapshot=EngineSnapshot(spec_decode=spec), num_waiting=0))
        return parse_spec_decode_counters(metrics.render().decode())

    before, after = scrape(10, 30, 12, [8, 3, 1]), scrape(30, 90, 42, [24, 12, 6])
    delta = spec_decode_delta(before, after)
    assert (delta["drafts"], delta["draft_tokens"], delta["accepted_tokens"]) == (20, 60, 30)
    assert delta["acceptance_rate"] == 0.5 and delta["mean_acceptance_length"] == 2.5
    assert delta["acceptance_per_pos"] == [0.8, 0.45, 0.25]
    assert parse_spec_decode_counters("pagedserve:num_preemptions_total 0.0\n") is None
    assert spec_decode_delta(None, after) is None
