"""The results plot: episode return against env steps and against wall-clock time."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from replay_fsm.files import write_bytes


def curve(episodes: list[dict[str, Any]], window: int) -> dict[str, list[float]]:
    """Env steps, wall seconds and the mean return of the last ``window`` episodes, at
    each env-step count where episodes finished."""
    ordered = sorted(episodes, key=lambda e: (e["env_steps"], e["wall_s"]))
    if not ordered:
        return {"env_steps": [], "wall_s": [], "mean_return": []}
    returns = np.asarray([e["return"] for e in ordered], dtype=np.float64)
    kernel = np.ones(max(1, window))
    sums = np.convolve(returns, kernel)[: len(returns)]
    counts = np.convolve(np.ones_like(returns), kernel)[: len(returns)]
    means = sums / np.maximum(counts, 1)
    # Episodes of several envs often end on the same step: one point per step count.
    last = [i for i in range(len(ordered))
            if i + 1 == len(ordered) or ordered[i + 1]["env_steps"] != ordered[i]["env_steps"]]
    return {"env_steps": [ordered[i]["env_steps"] for i in last],
            "wall_s": [ordered[i]["wall_s"] for i in last],
            "mean_return": [float(means[i]) for i in last]}


def plot(runs: dict[str, dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Draw every run's curve in two panels and write a PNG to ``path``.

    Raises:
        ImportError: matplotlib is missing (the ``mujoco`` extra installs it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("the plot needs matplotlib: pip install 'replay-fsm[mujoco]'"
                          ) from exc
    fig = figure(plt, runs, title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    # Whole or not at all, as the result beside it: savefig wrote in place, and a stop
    # or a full disk meanwhile left a cut PNG where the earlier plot was.
    return write_bytes(out, image.getvalue())


def figure(plt: Any, runs: dict[str, dict[str, Any]], title: str = "") -> Any:
    """``plot``'s figure, drawn with ``plt`` (matplotlib.pyplot). A run in which no
    episode finished (too few ticks for one) has no curve: the panels say so, where
    they were left empty."""
    fig, (by_steps, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    styles = {"pipeline": ("tab:blue", "-"), "sync": ("tab:orange", "--")}
    none: list[str] = []  # the runs in which no episode finished
    for name, run in runs.items():
        color, dash = styles.get(name, (None, "-"))
        label = {"pipeline": "pipeline", "sync": "synchronous sampling"}.get(name, name)
        c = curve(run["episodes"], run["config"]["num_envs"])
        by_steps.plot(c["env_steps"], c["mean_return"], dash, color=color, marker=".",
                      label=label)
        by_time.plot(c["wall_s"], c["mean_return"], dash, color=color, marker=".",
                     label=f"{label} ({run['loop_s']:.0f} s for {run['updates']} updates)")
        if not c["env_steps"]:
            none.append(label)
    by_steps.set_xlabel("environment steps")
    window = next(iter(runs.values()))["config"]["num_envs"]
    by_steps.set_ylabel(f"episode return (mean of the last {window})")
    by_time.set_xlabel("wall-clock seconds since the first tick")
    for ax in (by_steps, by_time):
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        if none:
            ax.text(0.5, 0.5, f"no episode finished ({', '.join(none)}): more ticks, or "
                    "a task with shorter episodes", transform=ax.transAxes,
                    ha="center", va="center", fontsize=9, wrap=True)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
