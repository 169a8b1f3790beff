"""--plot DIR: batch composition and KV usage over time, and ITL distributions, per policy."""
from __future__ import annotations

from pathlib import Path

from .simulator import SimResult


def write_plots(results: dict[str, SimResult], out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for policy, res in results.items():
        fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
        t = [s.start for s in res.steps]
        ax1.step(t, [s.decode_rows for s in res.steps], where="post", label="decode rows", lw=0.8)
        ax1.step(t, [s.prefill_tokens for s in res.steps], where="post", label="prefill tokens", lw=0.8)
        ax1.set_ylabel("per step")
        ax1.legend(loc="upper right")
        ax1.set_title(f"{policy}: batch composition and KV usage")
        ax2.step(t, [100 * s.kv_usage for s in res.steps], where="post", lw=0.8, color="tab:green")
        ax2.set_ylabel("KV blocks used (%)")
        ax2.set_xlabel("simulated time (s)")
        path = out / f"timeline_{policy}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(8, 5))
    for policy, res in results.items():
        itls = sorted(1e3 * x for r in res.records for x in r.itls)
        if itls:
            ax.plot(itls, [i / len(itls) for i in range(1, len(itls) + 1)], label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("fraction of gaps <= x")
    ax.set_title("ITL distribution (CDF)")
    ax.legend()
    path = out / "itl_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
