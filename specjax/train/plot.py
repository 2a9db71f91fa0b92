"""Loss / accuracy curves of a training log (train_log.jsonl) as a PNG (matplotlib, Agg backend)."""
from __future__ import annotations

import json
from pathlib import Path


def plot_curves(log_path: str | Path, png: str | Path) -> Path | None:
    log_path = Path(log_path)
    rows = [json.loads(ln) for ln in log_path.read_text().splitlines() if ln.strip()] if log_path.is_file() else []
    if not rows:
        return None
    try:
        import matplotlib
    except ImportError:  # plots are optional: the log has every number
        print("[train] matplotlib is not installed: no curves.png", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    K = len(rows[0]["loss"])
    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(11, 4))
    ax_l.plot(steps, [r["total"] for r in rows], color="black", lw=2, label="weighted total")
    for j in range(K):
        ax_l.plot(steps, [r["loss"][j] for r in rows], lw=1, label=f"step {j}")
        ax_a.plot(steps, [r["acc"][j] for r in rows], lw=1, color=f"C{j}", label=f"train step {j}")
    held = [r for r in rows if "heldout" in r]
    if held:
        hs = [r["step"] for r in held]
        for j in range(len(held[0]["heldout"]["acc"])):
            ax_a.plot(hs, [r["heldout"]["acc"][j] for r in held], lw=1.5, ls="--", marker="o", ms=3,
                      color=f"C{j}", label=f"held-out acc@{j + 1}")
    ax_l.set(xlabel="training step", ylabel="cross-entropy", title="loss", yscale="log")
    ax_a.set(xlabel="training step", ylabel="top-1 accuracy", title="accuracy (draft step j)", ylim=(0, 1))
    for ax in (ax_l, ax_a):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
