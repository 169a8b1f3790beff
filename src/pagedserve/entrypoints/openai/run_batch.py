"""`pagedserve run-batch -i in.jsonl -o out.jsonl --model M`: a batch file run offline, with
vLLM's flags and OpenAI's line formats. The server's app is built around the engine but
never bound to a port: each line runs through the route handler that would serve it live
(batch_execution.py), and its answer is written as a line of the server's output files."""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ...engine_config import EngineConfig
from .batch_lines import BATCH_ENDPOINTS, ParsedInput, dumps, openai_line, parse_input
from .batch_store import Line, LineResult, new_id

if TYPE_CHECKING:
    from fastapi import FastAPI

_DEFAULT_CONCURRENCY = 16


def add_run_batch_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run-batch", help="run an OpenAI batch file (JSONL) offline, writing the output lines the "
                                         "server's batches write (docs/batches.md)")
    p.add_argument("-i", "--input-file", required=True, help="the requests, one JSON line each: custom_id, method, "
                                                             f"url (one of {', '.join(BATCH_ENDPOINTS)}), body")
    p.add_argument("-o", "--output-file", required=True, help="where the answers go, one line per request")
    p.add_argument("--max-concurrency", type=int, default=_DEFAULT_CONCURRENCY,
                   help=f"lines in flight at once (default {_DEFAULT_CONCURRENCY})")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_run_batch)


def cmd_run_batch(args: argparse.Namespace) -> int:
    # The engine and the web stack load only when the command runs, not when the CLI's parser is built.
    from ...engine.llm_engine import LLMEngine
    from .args import ServerConfig
    from .server import build_app

    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    with open(args.input_file, "rb") as f:
        parsed = parse_input("run-batch", BATCH_ENDPOINTS, f)
    if parsed.errors:
        raise ValueError(f"--input-file {args.input_file}: " + "; ".join(e["message"] for e in parsed.errors))
    config = ServerConfig(engine=EngineConfig.from_cli_args(args), dashboard=False)
    app = build_app(LLMEngine(config.engine), config)
    # Lines the endpoints refused are answers too (in the output file): the run itself succeeded.
    asyncio.run(_run(app, parsed, Path(args.output_file), args.max_concurrency, sys.stderr))
    return 0


async def _run(app: FastAPI, parsed: ParsedInput, output: Path, concurrency: int, progress: TextIO) -> None:
    """Run every line, writing the answers in input order."""
    from .batch_execution import LineExecutor

    async with app.router.lifespan_context(app):
        executor = LineExecutor.from_app(app, BATCH_ENDPOINTS)
        slots = asyncio.Semaphore(concurrency)
        total, done = len(parsed.lines) + len(parsed.early), len(parsed.early)

        async def run(line: Line) -> LineResult:
            nonlocal done
            async with slots:
                answer = await executor.run(parsed.urls[line.idx], line.body)
            done += 1
            progress.write(f"\rrun-batch: {done}/{total} lines")
            return LineResult(line.idx, line.custom_id, answer.status_code, new_id("batch_req_"), answer.body)

        results = [*parsed.early, *await asyncio.gather(*(run(line) for line in parsed.lines))]
    progress.write(f"\rrun-batch: {done}/{total} lines, {sum(r.status_code != 200 for r in results)} failed\n")
    results.sort(key=lambda r: r.idx)
    with open(output, "w", encoding="utf-8") as f:
        for result in results:
            f.write(dumps(openai_line(result)) + "\n")
