"""Property-based runs of schemathesis against a live server's own /openapi.json.

Each operation gets `examples` positive cases (bodies the schema allows) and as many
negative ones (bodies it forbids), every response checked by schemathesis: no 5xx, the
status code and content type documented, the body valid against the documented
schema, and schema-violating bodies refused with a 4xx. The counts of statuses per
operation come back so a run can report what it sent and what came back.

The default test run uses it with a few hundred cases per operation
(test_server_openapi.py); `make fuzz` runs it as a script with 10,000:

    python -m tests.server.api_fuzz --examples 10000 --shapes all --out fuzz-results/api.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import hypothesis
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_headers_conformance, response_schema_conformance,
                                 status_code_conformance)
from schemathesis.core.failures import FailureGroup

# Not positive_data_acceptance: the schema cannot say "prompt tokens + max_tokens within
# the context" or "token ids below the vocabulary size", so some bodies it allows get a
# (documented, correct) 400.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]
# Flags of a server made for fuzzing: a short context keeps every generated request
# (a chat with no max_tokens runs to the context length) to a fraction of a second.
FUZZ_SERVER_FLAGS = ("--max-model-len", "40", "--max-n", "2", "--max-queued-requests", "4")
CALL_TIMEOUT_S = 60.0
# Event streams that run until the client leaves, with no input to vary: a case would only
# wait out CALL_TIMEOUT_S. test_server_shapes.py reads their first bytes on every engine shape.
UNFUZZED = frozenset({"GET /v1/kv_events", "GET /dashboard/events"})


@dataclass
class OperationRun:
    label: str
    mode: str
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def cases(self) -> int:
        return sum(self.statuses.values())


def load_schema(base_url: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json")


def fuzz_operation(operation: schemathesis.APIOperation, base_url: str, mode: GenerationMode, examples: int,
                   seed: int | None = None) -> OperationRun:
    """Run `examples` cases of `operation`; every failing check is recorded, not raised,
    so one run reports all it found (hypothesis would stop at the first and shrink)."""
    run = OperationRun(operation.label, mode.value)
    session_headers = {"Connection": "close"} if mode is GenerationMode.NEGATIVE else {}

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is None,
              suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def one(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, timeout=CALL_TIMEOUT_S, headers=session_headers)
        run.statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        # One failing check is an AssertionError; several come as a FailureGroup (an
        # ExceptionGroup, which `except AssertionError` does not catch).
        except (AssertionError, FailureGroup) as failure:
            if len(run.failures) < 20:
                run.failures.append(f"{response.status_code} {case.body!r:.300}: {str(failure)[:600]}")

    if seed is not None:
        one = hypothesis.seed(seed)(one)
    start = time.monotonic()
    try:
        one()
    except hypothesis.errors.Unsatisfiable:
        pass  # no negative case exists for an operation that takes no input: nothing to send
    run.seconds = time.monotonic() - start
    return run


def fuzz_all(base_url: str, examples: int, seed: int | None = None) -> list[OperationRun]:
    schema = load_schema(base_url)
    runs = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.label in UNFUZZED:
            continue
        for mode in GenerationMode:
            runs.append(fuzz_operation(operation, base_url, mode, examples, seed))
            print(summary(runs[-1]), file=sys.stderr, flush=True)
    return runs


def _fuzz_shard(base_url: str, label: str, mode: str, examples: int, seed: int) -> OperationRun:
    operation = next(r.ok() for r in load_schema(base_url).get_all_operations() if r.ok().label == label)
    return fuzz_operation(operation, base_url, GenerationMode(mode), examples, seed)


def fuzz_parallel(base_url: str, examples: int, workers: int, seed: int | None = None) -> list[OperationRun]:
    """fuzz_all with each operation's cases split into `workers` shards of distinct seeds,
    run by that many client processes at once: the server batches their requests, so the
    cases that generate tokens (most of a run's time) go several times faster. The counts
    add up per operation and mode; `seconds` is the sum of the shards' times."""
    from concurrent.futures import ProcessPoolExecutor

    labels = [r.ok().label for r in load_schema(base_url).get_all_operations() if r.ok().label not in UNFUZZED]
    shards = [(label, mode.value, examples // workers + (i < examples % workers), (seed or 0) * 1000 + i)
              for label in labels for mode in GenerationMode for i in range(workers)]
    with ProcessPoolExecutor(workers) as pool:
        done = list(pool.map(_fuzz_shard, [base_url] * len(shards), *zip(*shards)))
    runs: dict[tuple[str, str], OperationRun] = {}
    for run in done:
        merged = runs.setdefault((run.label, run.mode), OperationRun(run.label, run.mode))
        merged.statuses.update(run.statuses)
        merged.failures.extend(run.failures[: 20 - len(merged.failures)])
        merged.seconds += run.seconds
    for run in runs.values():
        print(summary(run), file=sys.stderr, flush=True)
    return list(runs.values())


def summary(run: OperationRun) -> str:
    statuses = ", ".join(f"{status}: {count}" for status, count in sorted(run.statuses.items()))
    return f"{run.label} [{run.mode}] {run.cases} cases in {run.seconds:.0f} s ({statuses}); " \
           f"{len(run.failures)} failures"


def main() -> int:
    from .server_process import ENGINE_SHAPES, start_server

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=10_000, help="cases per operation and mode")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: derandomized)")
    parser.add_argument("--out", type=Path, default=Path("fuzz-results/api.json"))
    parser.add_argument("--workers", type=int, default=1,
                        help="client processes at once, each on its own shard of every operation's cases")
    parser.add_argument("--shapes", default="default",
                        help="comma-separated engine shapes to start a server in and fuzz, or 'all': default, "
                             + ", ".join(ENGINE_SHAPES))
    args = parser.parse_args()
    shapes = ["default", *ENGINE_SHAPES] if args.shapes == "all" else args.shapes.split(",")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"examples_per_operation_and_mode": args.examples, "workers": args.workers, "shapes": {}}
    ok = True
    for shape in shapes:
        flags = (*FUZZ_SERVER_FLAGS, *ENGINE_SHAPES.get(shape, ()))
        server = start_server(args.out.parent, *flags)
        try:
            runs = (fuzz_parallel(server.url, args.examples, args.workers, args.seed) if args.workers > 1
                    else fuzz_all(server.url, args.examples, args.seed))
            healthy = server.proc.poll() is None
        finally:
            exit_code = server.stop()
        ok = ok and healthy and exit_code == 0 and not any(r.failures for r in runs)
        report["shapes"][shape] = {
            "server_flags": list(flags),
            "server_alive_after": healthy,
            "server_exit_code": exit_code,
            "operations": [{"operation": r.label, "mode": r.mode, "cases": r.cases, "seconds": round(r.seconds, 1),
                            "statuses": {str(k): v for k, v in sorted(r.statuses.items())}, "failures": r.failures}
                           for r in runs],
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
