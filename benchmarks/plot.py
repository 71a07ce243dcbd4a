"""`ttft.png`: time to first token against prompt length, four ways, one panel per model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.targets import WAY_LABELS


def write_plot(r: dict[str, Any], path: Path) -> None:
    """TTFT against prompt length, one panel per model, one line per way (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    cases = r.get("ttft", {}).get("cases", [])
    models = list(dict.fromkeys(c["model"] for c in cases))
    fig, axes = plt.subplots(
        1, max(1, len(models)), figsize=(5.5 * max(1, len(models)), 4.2), squeeze=False
    )
    for ax, model in zip(axes[0], models, strict=False):
        mine = sorted((c for c in cases if c["model"] == model), key=lambda c: c["tokens"])
        xs = [c["tokens"] for c in mine]
        for way, label in WAY_LABELS.items():
            ax.plot(xs, [c["ttft_s"][way] * 1e3 for c in mine], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("time to first token (ms, median)")
        ax.set_title(model)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    m = r.get("machine", {})
    fig.suptitle(
        f"cas_bank TTFT, {m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('date', '')}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
