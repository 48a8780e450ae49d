"""Chart of bench_gpu_prefill --json: time per case (log scale) for this library, FlashKDA and FLA
(both from targets.md; FLA lists P1-P7 only), with the 'must' bar of each case.

Usage: python3 bench/plot_prefill.py prefill.json docs/prefill_cases.png   (needs matplotlib)
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(src: str, dst: str) -> None:
    with open(src) as f:
        data = json.load(f)
    cases = data["cases"]
    names = [c["case"] for c in cases]
    x = range(len(cases))
    w = 0.27
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ax.bar([i - w for i in x], [c["ms"] for c in cases], w, label="this library")
    ax.bar(x, [c["flashkda_ms"] for c in cases], w, label="FlashKDA (targets.md)")
    fla = [c["fla_target_ms"] if c["fla_target_ms"] > 0 else 0 for c in cases]
    ax.bar([i + w for i in x], fla, w, label="FLA (targets.md; P cases)")
    ax.scatter(
        x,
        [c["must_ms"] for c in cases],
        marker="_",
        s=400,
        color="black",
        label="must (targets.md)",
        zorder=3,
    )
    ax.set_yscale("log")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names)
    ax.set_ylabel("ms per call (log scale)")
    ax.set_title(f"CUDA prefill on {data['device']}: bench_gpu_prefill, CUDA-event medians")
    ax.legend(fontsize=8, ncol=4, loc="upper left")
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
