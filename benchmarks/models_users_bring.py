"""pagedserve against llama-server on the GGUF files users download (K-quants, Q5_0 rows):
start-up time, resident memory and streaming throughput, one server at a time, with the
same client (`pagedserve bench serve`) and the same KV capacity in tokens.

    .venv/bin/python benchmarks/models_users_bring.py --llama-server PATH/llama-server \
        --model smol-q4km.gguf --model llama1b-q4km.gguf [--workloads W1,W2] [--rounds 1] \
        [--pagedserve default= --pagedserve "int8=--quantization gguf --kv-cache-dtype fp16"] \
        [--out benchmarks/results/models_users_bring.json]

For each model, workload and round, each server is started fresh (each pagedserve variant
with its flags, default: none, and --kv-cache-memory sized to the workload's tokens in
its KV dtype; llama-server with
`-t 2`, `-np` matched to the concurrency and `-c` the same token count), timed to its first
good /health, warmed with one request, loaded with the workload (fresh seed per round,
token-id prompts, ignore_eos), then its resident memory (the process tree's VmRSS) is
read and it is stopped. The servers alternate which goes first from round to round.
Make the files with llama.cpp's converter and llama-quantize (../shared/PEERS.md) or
`python -m pagedserve.model.gguf_rewrite`; nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@dataclass(frozen=True)
class Workload:
    concurrency: int
    requests: int
    prompt: int
    output: int

    @property
    def tokens(self) -> int:  # KV capacity both servers get: every stream's whole sequence
        return self.concurrency * (self.prompt + self.output + 64)


WORKLOADS = {"W1": Workload(1, 8, 128, 128), "W2": Workload(16, 64, 128, 128), "W3": Workload(64, 128, 256, 128)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss_mib(pid: int) -> float:
    """VmRSS of pid and its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            continue
    return total / 1024


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


def kv_bytes_per_token(model: Path, flags: list[str]) -> int:
    """pagedserve's KV bytes per token of this model with these flags (fp32 unless an
    --kv-cache-dtype says otherwise)."""
    sys.path.insert(0, str(REPO / "src"))
    from pagedserve.model.loader import gguf_header

    c = gguf_header(model).config
    dtype = flags[flags.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in flags else "auto"
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * {"fp16": 2, "bf16": 2}.get(dtype, 1 if "fp8" in dtype else 4)


def server_command(server: str, model: Path, port: int, w: Workload, llama: str, variants: dict) -> list[str]:
    if server == "llama-server":
        return [llama, "-m", str(model), "-t", "2", "-np", str(w.concurrency), "-c", str(w.tokens),
                "--host", "127.0.0.1", "--port", str(port)]
    flags = variants[server]
    kv = w.tokens * kv_bytes_per_token(model, flags)
    return [PYTHON, "-m", "pagedserve.entrypoints.cli", "serve", "--model", str(model), "--port", str(port),
            "--kv-cache-memory", str(kv), *flags]


def run_one(server: str, model: Path, name: str, w: Workload, seed: int, llama: str, variants: dict,
            logs: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(server, model, port, w, llama, variants)
    log = open(logs / f"{server}-{model.stem}-{name}-{seed}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    try:
        startup = wait_healthy(url, proc, timeout=600)
        bench = [PYTHON, "-m", "pagedserve.entrypoints.cli", "bench", "serve", "--base-url", url,
                 "--dataset-name", "random", "--input-len", str(w.prompt), "--output-len", str(w.output),
                 "--range-ratio", "0", "--ignore-eos", "--no-progress"]
        subprocess.run(bench + ["--num-prompts", "1", "--max-concurrency", "1", "--seed", str(seed + 999)],
                       check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        out = logs / f"{server}-{model.stem}-{name}-{seed}.json"
        subprocess.run(bench + ["--num-prompts", str(w.requests), "--max-concurrency", str(w.concurrency),
                                "--seed", str(seed), "--out", str(out), "--server-flags", " ".join(cmd)],
                       check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        s = json.loads(out.read_text())["summary"]
        return {"startup_s": round(startup, 2), "rss_mib": round(tree_rss_mib(proc.pid)),
                "tok_s": round(s["output_throughput"], 2), "p99_itl_ms": round(s["p99_itl_ms"], 1),
                "completed": s["completed"], "command": " ".join(cmd)}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def type_mix(model: Path) -> str:
    sys.path.insert(0, str(REPO / "src"))
    from pagedserve.model.gguf_file import read_tensors

    counts = Counter(t.qtype.name for t in read_tensors(model) if len(t.shape) == 2)
    return ", ".join(f"{n} {k}" for k, n in counts.most_common())


def cpu_name() -> str:
    sys.path.insert(0, str(REPO / "src"))
    from pagedserve.kernels import cpu_model_name

    return cpu_model_name()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, type=Path)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--workloads", default="W1,W2")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    ap.add_argument("--pagedserve", action="append", metavar="NAME=FLAGS",
                    help="a pagedserve variant and its serve flags (repeatable); default: default= (no flags)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    names = args.workloads.split(",")
    variants = {f"pagedserve {v.partition('=')[0]}": v.partition("=")[2].split() for v in args.pagedserve or ["default="]}
    servers = [*variants, "llama-server"]
    logs = Path(tempfile.mkdtemp(prefix="models-users-bring-"))
    results = []
    for model in args.model:
        row = {"model": model.name, "file_mib": round(model.stat().st_size / 2**20), "types": type_mix(model),
               "runs": []}
        for r in range(args.rounds):
            for name in names:
                order = servers if r % 2 == 0 else servers[::-1]
                for server in order:
                    seed = args.seed + 1000 * r
                    res = run_one(server, model, name, WORKLOADS[name], seed, args.llama_server, variants, logs)
                    row["runs"].append({"server": server, "workload": name, "round": r, **res})
                    print(f"{model.name} {name} round {r} {server}: {res['tok_s']} tok/s, p99 ITL "
                          f"{res['p99_itl_ms']} ms, start {res['startup_s']} s, RSS {res['rss_mib']} MiB", flush=True)
        results.append(row)
    report = {"cpu": cpu_name(), "machine": platform.machine(), "seed": args.seed, "logs": str(logs),
              "results": results}
    for row in results:
        print(f"\n{row['model']} ({row['file_mib']} MiB; {row['types']})")
        for name in names:
            def best(server: str, key: str, better=max) -> float:
                return better(x[key] for x in row["runs"] if x["server"] == server and x["workload"] == name)
            ll = best("llama-server", "tok_s")
            for v in variants:
                ps = best(v, "tok_s")
                print(f"  {name}: {v} {ps} tok/s vs llama-server {ll} ({ps / ll:.2f}x); p99 ITL "
                      f"{best(v, 'p99_itl_ms', min)} vs {best('llama-server', 'p99_itl_ms', min)} ms; "
                      f"start {best(v, 'startup_s', min)} vs {best('llama-server', 'startup_s', min)} s; "
                      f"RSS {best(v, 'rss_mib', min)} vs {best('llama-server', 'rss_mib', min)} MiB")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
