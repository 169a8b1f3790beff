"""Property-based runs of schemathesis against a live server's own /openapi.json.

Each operation gets `examples` positive cases (bodies the schema allows) and as many
negative ones (bodies it forbids), every response checked by schemathesis: no 5xx, the
status code and content type documented, the body valid against the documented
schema, and schema-violating bodies refused with a 4xx. The counts of statuses per
operation come back so a run can report what it sent and what came back.

The default test run uses it with a few hundred cases per operation
(test_server_openapi.py) and a few on every engine shape and router mode
(test_server_shapes.py, tests/router/test_router_fuzz.py); `make fuzz` runs it as a
script with 10,000 on each (a router's cases go against its own document):

    python -m tests.server.api_fuzz --examples 10000 --shapes all --out fuzz-results/api.json

The JSON holds, per shape and operation, the counts by status and the failures; the run
fails (exit 1) on any 5xx, failed check or request that got no answer, or a process that
did not stay healthy or stop cleanly on SIGTERM.
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
import requests
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
# (a chat with no max_tokens runs to the context length) to a fraction of a second. One
# thread: several fuzz servers (a router's) share the machine, and on a loaded one a server
# whose threads wait on each other generated ~10x slower (377 s against 38 s for 300 cases).
FUZZ_SERVER_FLAGS = ("--max-model-len", "40", "--max-n", "2", "--max-queued-requests", "4", "--num-threads", "1")
CALL_TIMEOUT_S = 60.0
MAX_FAILURES_KEPT = 20
# Event streams that run until the client leaves, with no input to vary: a case would only
# wait out CALL_TIMEOUT_S. test_server_shapes.py reads their first bytes on every engine shape.
UNFUZZED = frozenset({"GET /v1/kv_events", "GET /dashboard/events"})


@dataclass
class OperationRun:
    label: str
    mode: str
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    unanswered: int = 0  # cases whose request got no response (refused, reset, timed out)
    seconds: float = 0.0

    @property
    def cases(self) -> int:
        return sum(self.statuses.values()) + self.unanswered

    @property
    def server_errors(self) -> int:
        return sum(count for status, count in self.statuses.items() if status >= 500)

    def note(self, failure: str) -> None:
        if len(self.failures) < MAX_FAILURES_KEPT:
            self.failures.append(failure)


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
        try:
            response = case.call(base_url=base_url, timeout=CALL_TIMEOUT_S, headers=session_headers)
        # Counted, not raised: a long run goes on to report everything else it finds.
        except requests.RequestException as error:
            run.unanswered += 1
            run.note(f"no answer to {case.body!r:.300}: {type(error).__name__}: {str(error)[:300]}")
            return
        run.statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        # One failing check is an AssertionError; several come as a FailureGroup (an
        # ExceptionGroup, which `except AssertionError` does not catch).
        except (AssertionError, FailureGroup) as failure:
            run.note(f"{response.status_code} {case.body!r:.300}: {str(failure)[:600]}")

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
        merged.unanswered += run.unanswered
        for failure in run.failures:
            merged.note(failure)
        merged.seconds += run.seconds
    for run in runs.values():
        print(summary(run), file=sys.stderr, flush=True)
    return list(runs.values())


def summary(run: OperationRun) -> str:
    statuses = ", ".join(f"{status}: {count}" for status, count in sorted(run.statuses.items()))
    unanswered = f", {run.unanswered} unanswered" if run.unanswered else ""
    return f"{run.label} [{run.mode}] {run.cases} cases in {run.seconds:.0f} s ({statuses}{unanswered}); " \
           f"{len(run.failures)} failures"


def shape_report(commands: list[list[str]], runs: list[OperationRun], healthy: bool, exit_codes: list[int],
                 stopped_cleanly: bool) -> dict:
    """One shape's part of the JSON: its totals, then the counts by status per operation and mode."""
    return {
        "commands": commands,  # the front (server or router) first, as exit_codes
        "cases": sum(r.cases for r in runs),
        "5xx": sum(r.server_errors for r in runs),
        "unanswered": sum(r.unanswered for r in runs),
        "failures": sum(len(r.failures) for r in runs),
        "healthy_after": healthy,
        "exit_codes": exit_codes,
        "stopped_cleanly": stopped_cleanly,
        "operations": [{"operation": r.label, "mode": r.mode, "cases": r.cases, "seconds": round(r.seconds, 1),
                        "statuses": {str(k): v for k, v in sorted(r.statuses.items())}, "unanswered": r.unanswered,
                        "failures": r.failures}
                       for r in runs],
    }


def passed(shape: dict) -> bool:
    return (shape["healthy_after"] and shape["stopped_cleanly"]
            and shape["5xx"] == shape["unanswered"] == shape["failures"] == 0)


def markdown_table(report: dict) -> str:
    """The counts by status per shape and operation, as docs/reliability.md shows them; the
    operations that take no input (one case each, the same status) share a row."""
    lines = ["| shape | operation | positive | negative |", "|---|---|---|---|"]
    for name, shape in report["shapes"].items():
        by_label: dict[str, dict[str, str]] = {}
        for op in shape["operations"]:
            counts = ", ".join(f"{status}: {count:,}" for status, count in op["statuses"].items())
            by_label.setdefault(op["operation"], {})[op["mode"]] = counts or "none possible"
        no_input = [label for label, modes in by_label.items() if modes == {"positive": "200: 1",
                                                                           "negative": "none possible"}]
        for label, modes in by_label.items():
            if label not in no_input:
                lines.append(f"| {name} | {label} | {modes['positive']} | {modes['negative']} |")
        if no_input:
            lines.append(f"| {name} | {', '.join(no_input)} | 200: 1 each | none possible |")
        lines.append(f"| {name} | **all** ({shape['cases']:,} cases) | **{shape['5xx']} 5xx, {shape['failures']} "
                     f"failures, {shape['unanswered']} unanswered** | healthy after: {shape['healthy_after']}, "
                     f"exit codes {shape['exit_codes']} |")
    return "\n".join(lines)


def main() -> int:
    from .deployments import SHAPES, start_deployment

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=10_000, help="cases per operation and mode")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: derandomized)")
    parser.add_argument("--out", type=Path, default=Path("fuzz-results/api.json"))
    parser.add_argument("--workers", type=int, default=1,
                        help="client processes at once, each on its own shard of every operation's cases")
    parser.add_argument("--shapes", default="default",
                        help="comma-separated shapes to start and fuzz (a server in an engine shape, or a router "
                             "in front of servers), or 'all': " + ", ".join(SHAPES))
    args = parser.parse_args()
    shapes = SHAPES if args.shapes == "all" else args.shapes.split(",")
    if unknown := set(shapes) - set(SHAPES):
        parser.error(f"unknown shapes {sorted(unknown)}; known: {', '.join(SHAPES)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"examples_per_operation_and_mode": args.examples, "workers": args.workers, "shapes": {}}
    for shape in shapes:
        deployment = start_deployment(args.out.parent, shape, *FUZZ_SERVER_FLAGS)
        try:
            runs = (fuzz_parallel(deployment.url, args.examples, args.workers, args.seed) if args.workers > 1
                    else fuzz_all(deployment.url, args.examples, args.seed))
            healthy = deployment.healthy()
        finally:
            exit_codes = deployment.stop()
        commands = [list(p.proc.args[1:]) for p in deployment.processes]
        report["shapes"][shape] = shape_report(commands, runs, healthy, exit_codes,
                                               deployment.stopped_cleanly(exit_codes))
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_table(report), file=sys.stderr)
    failed = [name for name, shape in report["shapes"].items() if not passed(shape)]
    print(f"wrote {args.out}; " + (f"FAILED: {', '.join(failed)}" if failed else "every shape passed"),
          file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
