"""Plots the notebooks share: small fixed-size figures, so notebooks stay well under 1 MB."""
import math

import matplotlib.pyplot as plt

FIGSIZE, DPI = (7.0, 2.8), 72


def figure(ncols: int = 1, width: float = FIGSIZE[0], height: float = FIGSIZE[1]):
    """A small figure with ``ncols`` axes side by side."""
    fig, axes = plt.subplots(1, ncols, figsize=(width, height), dpi=DPI)
    return fig, axes


def short_name(name: str) -> str:
    """``model.layers.3.self_attn`` -> ``L3.self_attn`` for tick labels."""
    return name.replace("model.layers.", "L").replace("model.", "").replace("post_attention_layernorm",
                                                                           "post_ln").replace("input_layernorm", "in_ln")


def plot_layer_diffs(runs: dict, title: str = "max |tplab - HF| per sublayer", floor: float = 1e-9):
    """One line per run (label -> list of ``golden.Diff``): max abs diff against HF on a log scale.

    Exact matches sit on the floor; NaN/inf are drawn as red crosses at the top.
    """
    fig, ax = figure()
    names = [d.name for d in next(iter(runs.values()))]
    finite = [d.max_abs for rows in runs.values() for d in rows if math.isfinite(d.max_abs) and d.max_abs > 0]
    top = max(finite + [1.0]) * 10
    for label, rows in runs.items():
        ys = [top if not math.isfinite(d.max_abs) else max(d.max_abs, floor) for d in rows]
        line, = ax.plot(range(len(rows)), ys, marker=".", label=label)
        bad = [i for i, d in enumerate(rows) if not math.isfinite(d.max_abs)]
        if bad:
            ax.plot(bad, [top] * len(bad), "x", color="red", label=f"{label}: NaN/inf")
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, top * 3)
    step = max(1, len(names) // 12)
    ax.set_xticks(range(0, len(names), step), [short_name(n) for n in names[::step]], rotation=45,
                  ha="right", fontsize=7)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def interact(fn, **controls) -> None:
    """``ipywidgets.interact(fn, **controls)`` that also saves a static picture of ``fn``'s first
    state, so the cell shows a figure on GitHub and before the kernel runs; ``fn`` draws once per
    state (``tplab.teaching.interactive``)."""
    from tplab.teaching.interactive import interact as show    # ipywidgets only where a widget is shown
    show(fn, **controls)
