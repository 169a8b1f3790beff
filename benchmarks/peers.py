"""pagedserve beside its peers, one server at a time with the same client
(`pagedserve bench serve`): vLLM's CPU backend, llama-server, and any pagedserve variants,
on the workloads W1-W4 (`WORKLOADS` below, docs/benchmarks.md): output tok/s, p99 ITL, start-up time and resident memory.

    .venv/bin/python benchmarks/peers.py [--model FILE.gguf ...] [--workloads W1,W2,W3,W4] \
        [--llama-server PATH/llama-server] [--vllm DIR --hf-model HF_FOLDER] [--rounds 1] \
        [--pagedserve default= --pagedserve "fixed256=--quantization none --max-num-batched-tokens 256"] \
        [--out benchmarks/results/peers.json]

--model defaults to the embedded SmolLM2-135M-Instruct. --vllm is a folder
holding a CPU build of vLLM in its own venv (DIR/vllm/bin/python); vLLM serves --hf-model (the same weights as an
HF folder: it does not run these GGUFs) in fp32 (`vllm_command`), once per
model and round (its start-up is minutes), with the workloads run against it in turn.
pagedserve variants (default: `default=`, no flags) get --kv-cache-memory sized to the
workload's tokens in their KV dtype, and llama-server `-t 2`, `-np` matched to the
concurrency and `-c` the same token count; those two are started fresh per workload, timed
to their first good /health, warmed with one request, loaded with the workload (a fresh
seed per round, token-id prompts, ignore_eos), their resident memory (the process tree's
VmRSS) read, and stopped. Servers alternate which goes first from round to round. The
report names the CPU and its flags. Make other GGUFs with llama.cpp's converter and
llama-quantize or `python -m pagedserve.model.gguf_rewrite`; nothing is
downloaded.
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
    prompt: int  # the longest prompt
    output: int
    dataset: tuple[str, ...]  # `bench serve` dataset flags

    @property
    def tokens(self) -> int:  # KV capacity every server gets: each stream's longest sequence
        return self.concurrency * (self.prompt + self.output + 64)


def _random(prompt: int, output: int) -> tuple[str, ...]:
    return ("--dataset-name", "random", "--input-len", str(prompt), "--output-len", str(output), "--range-ratio", "0")


WORKLOADS = {
    "W1": Workload(1, 8, 128, 128, _random(128, 128)),
    "W2": Workload(16, 64, 128, 128, _random(128, 128)),
    "W3": Workload(64, 128, 256, 128, _random(256, 128)),
    # Mostly 64-token prompts, every eighth 2,000: the chunked-prefill stress case.
    "W4": Workload(32, 96, 2000, 64, ("--dataset-name", "mixed", "--short-input-len", "64", "--long-input-len",
                                      "2000", "--long-every", "8", "--output-len", "64", "--range-ratio", "0")),
}
VLLM = "vllm"
LLAMA = "llama-server"


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
    """pagedserve's KV bytes per token of this model with these flags: --kv-cache-dtype, else
    what "auto" resolves to on the native kernels (fp16 beside a GGUF's int8 path, else fp32)."""
    sys.path.insert(0, str(REPO / "src"))
    from pagedserve.model.loader import gguf_header

    c = gguf_header(model).config
    if "--kv-cache-dtype" in flags:
        dtype = flags[flags.index("--kv-cache-dtype") + 1]
    else:
        quantization = flags[flags.index("--quantization") + 1] if "--quantization" in flags else "auto"
        dtype = "fp16" if quantization in ("auto", "gguf") else "fp32"
    width = {"fp16": 2, "bf16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}.get(dtype, 4)
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * width


def pagedserve_command(model: Path, port: int, w: Workload, flags: list[str]) -> list[str]:
    kv = w.tokens * kv_bytes_per_token(model, flags)
    return [PYTHON, "-m", "pagedserve.entrypoints.cli", "serve", "--model", str(model), "--port", str(port),
            "--kv-cache-memory", str(kv), *flags]


def llama_command(llama: str, model: Path, port: int, w: Workload) -> list[str]:
    return [llama, "-m", str(model), "-t", "2", "-np", str(w.concurrency), "-c", str(w.tokens),
            "--host", "127.0.0.1", "--port", str(port)]


def vllm_command(vllm: Path, hf_model: Path, name: str, port: int) -> tuple[list[str], dict]:
    """vLLM's CPU backend as the comparisons run it: fp32, both cores, 8 GiB of KV."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "8"}
    return [str(vllm / "vllm" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(hf_model), "--served-model-name", name, "--port", str(port), "--dtype", "float32"], env


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of pid's process tree so far."""
    total, todo = 0.0, [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, IndexError, ProcessLookupError):
            continue
    return total


class Server:
    """One server process, started and timed to its first good /health."""

    def __init__(self, cmd: list[str], log: Path, env: dict | None = None, port: int = 0):
        self.cmd, self.url = cmd, f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO / "src"), **(env or {})})
        try:
            self.startup_s = wait_healthy(self.url, self.proc, timeout=900)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def run_workload(server: Server, w: Workload, seed: int, out: Path) -> dict:
    """A warm-up request, then the workload; the summary figures and the tree's RSS."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    bench = [PYTHON, "-m", "pagedserve.entrypoints.cli", "bench", "serve", "--base-url", server.url,
             *w.dataset, "--ignore-eos", "--no-progress"]
    subprocess.run(bench + ["--num-prompts", "1", "--max-concurrency", "1", "--seed", str(seed + 999)],
                   check=True, capture_output=True, env=env)
    subprocess.run(bench + ["--num-prompts", str(w.requests), "--max-concurrency", str(w.concurrency),
                            "--seed", str(seed), "--out", str(out), "--server-flags", " ".join(server.cmd)],
                   check=True, capture_output=True, env=env)
    s = json.loads(out.read_text())["summary"]
    return {"startup_s": round(server.startup_s, 2), "rss_mib": round(tree_rss_mib(server.proc.pid)),
            "tok_s": round(s["output_throughput"], 2), "p99_itl_ms": round(s["p99_itl_ms"], 1),
            "mean_itl_ms": round(s["mean_itl_ms"], 1), "mean_ttft_ms": round(s["mean_ttft_ms"], 1),
            "completed": s["completed"], "command": " ".join(server.cmd)}


def type_mix(model: Path) -> str:
    sys.path.insert(0, str(REPO / "src"))
    from pagedserve.model.gguf_file import read_tensors

    counts = Counter(t.qtype.name for t in read_tensors(model) if len(t.shape) == 2)
    return ", ".join(f"{n} {k}" for k, n in counts.most_common())


def cpu_name() -> str:
    sys.path.insert(0, str(REPO / "src"))
    from pagedserve.kernels import cpu_model_name

    return cpu_model_name()


def cpu_flags() -> list[str]:
    """The instruction-set flags the kernels and the peers choose paths by."""
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", type=Path, help="a .gguf (repeatable); default: the embedded model")
    ap.add_argument("--llama-server", help="llama-server's binary; without it llama-server is left out")
    ap.add_argument("--vllm", type=Path, help="the folder build_vllm_cpu.sh made; without it vLLM is left out")
    ap.add_argument("--hf-model", type=Path, help="with --vllm: the model as an HF folder (one --model only)")
    ap.add_argument("--workloads", default="W1,W2,W3,W4")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    ap.add_argument("--pagedserve", action="append", metavar="NAME=FLAGS",
                    help="a pagedserve variant and its serve flags (repeatable); default: default= (no flags)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    from pagedserve.model.registry import DEFAULT_MODEL_NAME, default_model_path

    models = args.model or [default_model_path()]
    if args.vllm and (not args.hf_model or len(models) != 1):
        ap.error("--vllm needs --hf-model, the HF folder of the one --model")
    names = args.workloads.split(",")
    variants = {f"pagedserve {v.partition('=')[0]}": v.partition("=")[2].split() for v in args.pagedserve or ["default="]}
    servers = [*variants, *([LLAMA] if args.llama_server else []), *([VLLM] if args.vllm else [])]
    logs = Path(tempfile.mkdtemp(prefix="peers-"))
    results = []
    for model in models:
        row = {"model": model.name, "file_mib": round(model.stat().st_size / 2**20), "types": type_mix(model),
               "runs": []}
        served_name = DEFAULT_MODEL_NAME if model == default_model_path() else model.stem
        for r in range(args.rounds):
            seed = args.seed + 1000 * r
            order = servers if r % 2 == 0 else servers[::-1]
            # vLLM starts in minutes: once a round, left up (idle) while the others run each workload.
            vllm = None
            if args.vllm:
                port = free_port()
                cmd, env = vllm_command(args.vllm, args.hf_model, served_name, port)
                vllm = Server(cmd, logs / f"vllm-{model.stem}-{seed}.log", env, port)
            try:
                for name in names:
                    w = WORKLOADS[name]
                    for server in order:
                        out = logs / f"{server.replace(' ', '-')}-{model.stem}-{name}-{seed}.json"
                        if server == VLLM:
                            res = run_workload(vllm, w, seed, out)
                        else:
                            port = free_port()
                            cmd = (llama_command(args.llama_server, model, port, w) if server == LLAMA
                                   else pagedserve_command(model, port, w, variants[server]))
                            idle = cpu_seconds(vllm.proc.pid) if vllm else 0.0
                            started = Server(cmd, logs / f"{server.replace(' ', '-')}-{model.stem}-{name}-{seed}.log",
                                             port=port)
                            try:
                                res = run_workload(started, w, seed, out)
                            finally:
                                started.stop()
                            if vllm:
                                res["vllm_idle_cpu_s"] = round(cpu_seconds(vllm.proc.pid) - idle, 2)
                        row["runs"].append({"server": server, "workload": name, "round": r, **res})
                        print(f"{model.name} {name} round {r} {server}: {res['tok_s']} tok/s, p99 ITL "
                              f"{res['p99_itl_ms']} ms, start {res['startup_s']} s, RSS {res['rss_mib']} MiB", flush=True)
            finally:
                if vllm:
                    vllm.stop()
        results.append(row)
    report = {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "machine": platform.machine(), "seed": args.seed,
              "logs": str(logs), "results": results}
    anchor = VLLM if args.vllm else (LLAMA if args.llama_server else None)
    print(f"\n{report['cpu']} ({' '.join(report['cpu_flags'])})")
    for row in results:
        print(f"{row['model']} ({row['file_mib']} MiB; {row['types']})")
        for name in names:
            def best(server: str, key: str, better=max) -> float:
                return better(x[key] for x in row["runs"] if x["server"] == server and x["workload"] == name)
            for server in servers:
                tok, p99 = best(server, "tok_s"), best(server, "p99_itl_ms", min)
                vs = (f" ({tok / best(anchor, 'tok_s'):.2f}x {anchor}, p99 {p99 / best(anchor, 'p99_itl_ms', min):.2f}x)"
                      if anchor and server != anchor else "")
                print(f"  {name} {server}: {tok} tok/s, p99 ITL {p99} ms{vs}; start {best(server, 'startup_s', min)} s,"
                      f" RSS {best(server, 'rss_mib', min)} MiB")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
