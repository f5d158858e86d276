"""Draw a memory_estimate JSON (benchmarks.memory.bench_memory_estimate) as docs/memory.png: per preset and
precision, rank 0's measured model states stacked by store (device, host, NVMe) beside the estimate.

    python -m benchmarks.memory.plot_memory_estimate docs/memory.png [--source RESULT.json]

The source defaults to the newest ``results/memory/memory_estimate.*.json`` (this machine's first).

Needs only matplotlib (``pip install 'lzero[plot]'``), not torch.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.common import latest_result


def main(source: str, target: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.load(open(source))
    labels = [f"{r['preset']}\n{r['precision']}" for r in rows]
    stores = (("device", "#4c72b0"), ("cpu", "#dd8452"), ("nvme", "#55a868"))
    fig, ax = plt.subplots(figsize=(14, 5))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for store, color in stores:
        heights = [sum(v for k, v in r["ranks"][0]["measured"].get(store, {}).items() if k != "buffers") / 1e6
                   for r in rows]
        ax.bar([i - 0.2 for i in x], heights, 0.4, bottom=bottom, color=color, label=f"measured: {store}")
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.bar([i + 0.2 for i in x], [r["ranks"][0]["expected"] / 1e6 for r in rows], 0.4, color="#8c8c8c",
           label="estimated (lzero.memory.estimate)")
    ax.set_xticks(list(x), [label.replace("_nvme", "\n_nvme") for label in labels], fontsize=7)
    ax.set_ylim(0, 1.12 * max(max(bottom), max(r["ranks"][0]["expected"] / 1e6 for r in rows)))
    ax.set_ylabel("model states per rank (MB)")
    ax.set_title(f"Demo GPT ({rows[0]['psi']:,} parameters), 2 ranks, AdamW: measured vs estimated, rank 0")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    print(f"wrote {target}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="the PNG to write")
    parser.add_argument("--source", default=None, help="a memory_estimate JSON (default: the newest)")
    args = parser.parse_args()
    main(args.source or str(latest_result("memory", "memory_estimate", "json")), args.target)
