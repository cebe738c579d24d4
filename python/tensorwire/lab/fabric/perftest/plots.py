"""The tests' plots (--plot; needs matplotlib): bandwidth and latency over
message size, and with --duration the throughput over time."""

from __future__ import annotations


def to_unit_plot(bytes_per_s: float, unit: str) -> float:
    from ..common import to_unit

    return to_unit(bytes_per_s, unit)


def plot_bw(report, path: str, unit: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.rows
    timed = bool(report.config.get("duration"))
    if timed:  # duration mode: also the throughput over time, from the per-lane bins
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for r in rows:
            raw = r["raw"]
            lanes = [raw["per_lane_bins"]] + ([raw["peer_per_lane_bins"]] if raw.get("peer_per_lane_bins") else [])
            nb = len(raw["per_lane_bins"][0]) if raw["per_lane_bins"] else 0
            counts = [sum(side[lane][b] for side in lanes for lane in range(len(side))) for b in range(nb)]
            ax2.plot(
                [(b + 0.5) * raw["bin_s"] for b in range(nb)],
                [to_unit_plot(c * r["size"] / raw["bin_s"], unit) for c in counts],
                lw=1,
                label=f"{r['size']} B",
            )
        m, d = report.config["margin"], report.config["duration"]
        ax2.axvspan(m, d - m, color="grey", alpha=0.15, label="sampled")
        ax2.set_xlabel("time [s]")
        ax2.set_ylabel(f"bandwidth [{unit}]")
        ax2.set_title("throughput over time (completions per 100 ms)")
        ax2.grid(True, alpha=0.3)
        ax2.legend(fontsize=7)
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = [r["size"] for r in rows]
    ax.plot(sizes, [r["bw_average"] for r in rows], "o-", label="BW average")
    if any(r["bw_peak"] for r in rows):
        ax.plot(sizes, [r["bw_peak"] for r in rows], "x--", label="BW peak")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size [bytes]")
    ax.set_ylabel(f"bandwidth [{unit}]")
    cfg = report.config
    ax.set_title(f"tensorwire {report.test} over {cfg['transport']}, {cfg['lanes']} lane(s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_lat(report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.rows
    sizes = [r["size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in (
        ("p50", "t_typical", "o-"),
        ("avg", "t_avg", "s-"),
        ("p99", "99%", "^--"),
        ("p99_9", "99.9%", "v:"),
        ("min", "t_min", ".-"),
    ):
        ax.plot(sizes, [r["lat_us"][key] for r in rows], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size [bytes]")
    rtt = report.config["op"] == "read"
    ax.set_ylabel("latency [usec]" + (" (full round trip)" if rtt else " (one-way, RTT/2)"))
    ax.set_title(f"tensorwire {report.test} over {report.config['transport']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
