"""`pagedserve sim cluster --ray-config CONFIG.yaml` prints settings.predict's prediction
for the YAML `pagedserve serve-ray` takes, on the workload flags; a file it cannot use is
an error that names it. No Ray: the prediction is the cluster simulator's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.entrypoints.cli import main
from pagedserve.entrypoints.ray_serve.settings import RayServeConfig, cluster_setup, predict
from pagedserve.sim.scenario import build_scenario
from pagedserve.workload.datasets import shared_prefix_dataset

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "ray" / "serve.yaml")
# docs/scale-out.md's measured two-replica run: 24 prompts in 4 groups, prefix 160, suffix 16, output 4.
WORKLOAD = ["--dataset-name", "shared-prefix", "--num-prompts", "24", "--num-groups", "4", "--prefix-len", "160",
            "--suffix-len", "16", "--output-len", "4", "--range-ratio", "0", "--request-rate", "8"]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["sim", "cluster", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_is_predict_for_the_same_inputs(capsys):
    rc, out, _ = _run(capsys, "--ray-config", EXAMPLE, *WORKLOAD, "--json")
    assert rc == 0
    printed = json.loads(out)
    expected = predict(RayServeConfig.load(EXAMPLE), shared_prefix_dataset(24, 4, 160, 16, 4), "smollm2-135m",
                       "h100-sxm5", 8.0)
    assert printed["replicas"] == expected
    assert [r["hit_rate"] for r in expected] == [pytest.approx(0.758, abs=0.001)] * 2  # the measured 0.758
    assert printed["setup"]["model"] == "smollm2-135m"  # the YAML names none: the engine's embedded model
    assert printed["num_replicas"] == 2 and printed["setup"]["policy"] == "cache_aware"


def test_the_table_shows_each_replica(capsys):
    rc, out, _ = _run(capsys, "--ray-config", EXAMPLE, *WORKLOAD)
    assert rc == 0
    rows = predict(RayServeConfig.load(EXAMPLE), shared_prefix_dataset(24, 4, 160, 16, 4), "smollm2-135m",
                   "h100-sxm5", 8.0)
    lines = out.splitlines()
    assert "2 replicas of smollm2-135m" in lines[0] and "1.00 GiB" in lines[0]
    assert lines[2].split() == ["replica", "requests", "hit", "rate", "out", "tok/s", "mean", "TTFT", "p90", "TTFT",
                                "mean", "TPOT"]
    for line, r in zip(lines[3:], rows, strict=True):
        assert line.split()[:3] == [str(r["replica"]), str(r["requests"]), f"{r['hit_rate']:.3f}"]


def test_the_kv_pool_follows_the_engine_section(tmp_path, capsys):
    path = tmp_path / "app.yaml"
    path.write_text("engine: {kv_cache_memory: 48MiB, block_size: 32, max_num_seqs: 8, max_num_batched_tokens: 256}\n"
                    "replicas: {num_replicas: 3}\nrouter: {policy: least_load}\n")
    rc, out, _ = _run(capsys, "--ray-config", str(path), "--model", "llama-3.1-8b", *WORKLOAD, "--json")
    assert rc == 0
    printed = json.loads(out)
    sc = build_scenario("llama-3.1-8b", "h100-sxm5", block_size=32, max_num_seqs=8, max_num_batched_tokens=256,
                        kv_cache_memory=48 << 20)
    assert printed["num_blocks"] == sc.plan.num_blocks == 48 << 20 >> 17 >> 5  # 128 KiB a token, 32 a block
    setup = cluster_setup(RayServeConfig.load(path), "llama-3.1-8b", "h100-sxm5")
    assert (setup.block_size, setup.kv_cache_memory, setup.max_num_seqs, setup.max_num_batched_tokens) == \
        (32, 48 << 20, 8, 256)
    assert len(printed["replicas"]) == 3 and printed["setup"]["policy"] == "least_load"


def test_engine_dtypes_map_onto_the_simulators():
    config = RayServeConfig.from_dict({"engine": {"dtype": "float16", "kv_cache_dtype": "fp8_e4m3"}})
    assert (cluster_setup(config, "llama-3.1-8b", "h100-sxm5").dtype,
            cluster_setup(config, "llama-3.1-8b", "h100-sxm5").kv_cache_dtype) == ("bf16", "fp8")
    assert cluster_setup(RayServeConfig(), "llama-3.1-8b", "h100-sxm5").dtype == "bf16"  # auto on a GPU


@pytest.mark.parametrize("content, message", [
    (None, "cannot read the config: No such file"),
    ("engine: [1,\n", "not valid YAML"),
    ("replicas: {num_replica: 2}\n", "replicas: unknown key(s) num_replica"),
    ("engine: {kv_cache_memory: lots}\n", "kv_cache_memory must be a size"),
    ("- 1\n", "a YAML mapping"),
])
def test_a_file_it_cannot_use_is_named(tmp_path, capsys, content, message):
    path = tmp_path / "app.yaml"
    if content is not None:
        path.write_text(content)
    rc, out, err = _run(capsys, "--ray-config", str(path), "--request-rate", "1")
    assert rc == 2 and out == ""
    assert err.startswith(f"error: {path}: ") and message in err


@pytest.mark.parametrize("flags, message", [
    (["--max-num-seqs", "4"], "drop --max-num-seqs"),
    (["--layouts", "4r"], "drop --layouts"),
    ([], "needs --request-rate"),
])
def test_flags_the_yaml_decides_are_refused(capsys, flags, message):
    argv = ["--ray-config", EXAMPLE, *flags] + (["--request-rate", "1"] if flags else [])
    rc, _, err = _run(capsys, *argv)
    assert rc == 2 and message in err


def test_without_ray_installed():
    code = ("import sys; sys.modules['ray'] = None  # `import ray` now fails\n"
            "from pagedserve.entrypoints.cli import main\n"
            f"rc = main(['sim', 'cluster', '--ray-config', {EXAMPLE!r}, *{WORKLOAD!r}, '--json'])\n"
            "assert rc == 0 and sys.modules['ray'] is None and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                   env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""})


def test_plain_sim_cluster_keeps_its_defaults(capsys):
    rc, out, _ = _run(capsys, "--layouts", "2r", "--dataset-name", "random", "--num-prompts", "8", "--input-len", "64",
                      "--output-len", "4", "--request-rate", "4")
    assert rc == 0
    assert out.startswith("llama-3.1-8b on h100-sxm5") and out.splitlines()[2].startswith("2r ")
