"""The scheduler-study table and plots for `bench compare`."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ..workload.serving_stats import summary_columns
from .compare import RunResult

# A CPU engine makes tens of tokens a second: throughput keeps a decimal.
COLUMNS = summary_columns(
    ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "kv_waste", "peak_blocks_used",
     "num_preemptions"),
    output_throughput="{:,.1f}",
)


def format_table(summaries: Mapping[str, Mapping], ratio_to: Mapping[str, float] | None = None) -> str:
    def cell(s: Mapping, key: str, fmt: str) -> str:
        v = s.get(key)
        return "-" if v is None or v != v else fmt.format(v)  # v != v: NaN (a baseline has no KV stats)

    head = f"{'policy':<11}" + "".join(f"{name:>14}" for name, _, _ in COLUMNS)
    if ratio_to:
        head += f"{'x naive':>10}"
    lines = [head]
    for name, s in summaries.items():
        line = f"{name:<11}" + "".join(f"{cell(s, key, fmt):>14}" for _, key, fmt in COLUMNS)
        if ratio_to:
            line += f"{ratio_to[name]:>10.2f}"
        lines.append(line)
    return "\n".join(lines)


def write_plots(runs: Mapping[str, RunResult], out_dir: str | Path) -> list[Path]:
    """itl.png (ITL distribution per run), timeline.png (running / waiting / KV usage per
    engine run), ttft.png (TTFT of each request, in dataset order)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, run in runs.items():
        itls = sorted(x * 1e3 for r in run.records for x in r.itls)
        if itls:
            ax.plot(itls, [(k + 1) / len(itls) for k in range(len(itls))], label=name)
    ax.set(xscale="log", xlabel="inter-token latency (ms)", ylabel="fraction of gaps <= x", title="ITL distribution")
    ax.legend()
    paths.append(_save(fig, out / "itl.png"))

    engine_runs = {n: r for n, r in runs.items() if r.steps}
    if engine_runs:
        fig, axes = plt.subplots(len(engine_runs), 1, figsize=(9, 2.6 * len(engine_runs)), squeeze=False)
        for ax, (name, run) in zip(axes[:, 0], engine_runs.items()):
            t = [s.time for s in run.steps]
            ax.step(t, [s.num_running for s in run.steps], where="post", label="running")
            ax.step(t, [s.num_waiting for s in run.steps], where="post", label="waiting")
            ax.set(ylabel="requests", title=name)
            kv = ax.twinx()
            kv.plot(t, [s.kv_usage * 100 for s in run.steps], color="tab:red", alpha=0.6, label="KV usage %")
            kv.set(ylabel="KV usage %", ylim=(0, 100))
            ax.legend(loc="upper left", fontsize="small")
            kv.legend(loc="upper right", fontsize="small")
        axes[-1, 0].set_xlabel("seconds")
        paths.append(_save(fig, out / "timeline.png"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, run in runs.items():
        pts = [(i, r.ttft) for i, r in enumerate(run.records) if r.token_times]
        ax.plot([i for i, _ in pts], [v for _, v in pts], ".", label=name)
    ax.set(xlabel="request (dataset order)", ylabel="TTFT (s)", title="time to first token per request")
    ax.legend()
    paths.append(_save(fig, out / "ttft.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
