"""Plots the notebooks share, in one style: figures about 9 inches wide at 100 dpi (900 px, the width of a
notebook's output area at 100% zoom), tick labels of 9 pt and more, so they read without zooming while
the notebooks stay well under 1 MB. Every figure of the notebooks is made by ``figure`` (or
``token_figure``), which applies ``STYLE``.

Every diff plot goes through ``draw_diffs``: a log axis for the finite differences, the bound
(``tplab.golden``) as a dashed line, and two bands of their own, "exact (0)" at the bottom and "NaN / inf" at the
top, so that neither is drawn at an arbitrary value; the legend sits outside the axes.
"""
import math

import matplotlib.pyplot as plt

FIGSIZE, DPI = (9.0, 3.2), 100
BAND = 30.0                 # height of the exact and NaN/inf bands, as a factor on the log axis
STYLE = {"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "xtick.labelsize": 9,
         "ytick.labelsize": 9, "legend.fontsize": 9, "figure.titlesize": 11, "figure.dpi": DPI,
         "savefig.dpi": DPI}   # the smallest text (ticks, legends) 9 pt: readable at 100% zoom


def use_style() -> None:
    """Apply ``STYLE`` (matplotlib reads its sizes when an artist is made, so before drawing)."""
    plt.rcParams.update(STYLE)


def figure(ncols: int = 1, width: float = FIGSIZE[0], height: float = FIGSIZE[1], layout: str | None = None):
    """A figure in the notebooks' style with ``ncols`` axes side by side (``layout``: matplotlib's, e.g.
    "constrained")."""
    use_style()
    fig, axes = plt.subplots(1, ncols, figsize=(width, height), dpi=DPI, layout=layout)
    return fig, axes


def short_name(name: str) -> str:
    """``model.layers.3.self_attn`` -> ``L3.self_attn`` for tick labels."""
    return name.replace("model.layers.", "L").replace("model.", "").replace("post_attention_layernorm",
                                                                           "post_ln").replace("input_layernorm", "in_ln")


def draw_diffs(ax, series: dict, tol=None, xs=None, ylabel: str = "max |tplab - HF|",
               xlabel: str = "") -> tuple[float, float]:
    """Plot ``series`` (label -> list of differences) on ``ax`` with a log y axis.

    Finite positive values are drawn where they are; zeros in an "exact (0)" band below them and
    NaN/inf (as red crosses) in a "NaN / inf" band above them; ``tol`` (one bound, or one per point,
    as ``golden.Diff.bound``) is a dashed line. Returns the ``(low, high)`` edges of the finite region."""
    values = [v for vs in series.values() for v in vs]
    if tol is None:
        bounds = []
    elif isinstance(tol, (int, float)):
        bounds = [tol] * len(values)                                        # one bound for every point
    else:
        bounds = list(tol)                                                  # one per point
    finite = [v for v in values + bounds if math.isfinite(v) and v > 0]
    low = 10 ** math.floor(math.log10(min(finite or [1e-6])))
    high = 10 ** math.ceil(math.log10(max(finite or [1.0]))) * 10
    exact_y, bad_y = low / math.sqrt(BAND), high * math.sqrt(BAND)           # the middle of each band
    ax.axhspan(low / BAND, low, color="0.92", lw=0)
    ax.axhspan(high, high * BAND, color="#fbe3e3", lw=0)
    for label, vs in series.items():
        x = list(xs) if xs is not None else list(range(len(vs)))
        ys = [bad_y if not math.isfinite(v) else exact_y if v == 0 else v for v in vs]
        line, = ax.plot(x, ys, marker=".", label=label)
        bad = [(xi, bad_y) for xi, v in zip(x, vs) if not math.isfinite(v)]
        if bad:
            ax.plot(*zip(*bad), "x", color="red", ms=6, label=f"{label}: NaN/inf")
    if isinstance(tol, (int, float)) and tol > 0:
        ax.axhline(tol, color="k", ls="--", lw=0.8, label=f"bound {tol:.0e}")
    elif bounds:
        x = list(xs) if xs is not None else list(range(len(bounds)))
        ax.plot(x, bounds, color="k", ls="--", lw=0.8, drawstyle="steps-mid", label="bound (tplab.golden)")
    ax.set_yscale("log")
    ax.set_ylim(low / BAND, high * BAND)
    inner = range(round(math.log10(low)) + 1, round(math.log10(high)))    # decades between the bands
    decades = [10.0 ** e for e in inner[::1 if len(inner) <= 5 else 2]]
    ax.set_yticks([exact_y, *decades, bad_y], ["exact 0", *(f"1e{round(math.log10(d))}" for d in decades),
                                               "NaN/inf"])
    ax.minorticks_off()
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)   # off the data
    return low, high


def plot_layer_diffs(runs: dict, title: str = "max |tplab - HF| per sublayer", tol=None,
                     xlabel: str = "sublayer, in forward order", ylabel: str = "max |tplab - HF|"):
    """One line per run (label -> list of ``golden.Diff``): max abs diff against HF per sublayer, on a
    log scale, with each sublayer's bound (the first run's, unless ``tol`` is given) as a dashed line
    and the exact and NaN/inf bands of ``draw_diffs``."""
    long_labels = max(map(len, runs)) > 28                  # beside the axes, such a legend would squeeze them
    fig, ax = figure(layout="constrained" if long_labels else None)
    first = next(iter(runs.values()))
    names = [d.name for d in first]
    tol = [d.bound for d in first] if tol is None else tol
    draw_diffs(ax, {label: [d.max_abs for d in rows] for label, rows in runs.items()}, tol,
               ylabel=ylabel, xlabel=xlabel)
    step = max(1, len(names) // 12)
    ax.set_xticks(range(0, len(names), step), [short_name(n) for n in names[::step]], rotation=45,
                  ha="right")
    ax.set_title(title)
    if long_labels:                                         # under the figure instead, taller by its lines
        handles, labels = ax.get_legend_handles_labels()
        ax.get_legend().remove()
        fig.set_figheight(FIGSIZE[1] + 0.25 * len(labels))
        fig.legend(handles, labels, loc="outside lower center", frameon=False)
    else:
        fig.tight_layout()
    return fig


def token_figure(pieces: list[str], colors: list, title: str, chars: int = 96, fontsize: float = 10):
    """Text drawn piece by piece (tokens, say) in monospace lines of at most ``chars`` characters, each
    piece on its own background colour (None: no background), under ``title``. Returns the figure."""
    if len(pieces) != len(colors):
        raise ValueError(f"one colour per piece: got {len(pieces)} pieces and {len(colors)} colours")
    placed, row, col = [], 0, 0
    for piece, color in zip(pieces, colors):
        for i, part in enumerate(piece.split("\n")):
            if i or (col and col + len(part) > chars):           # a newline in the piece, or a full line
                row, col = row + 1, 0
            placed.append((col, row, part, color))
            col += len(part)
    use_style()
    fig = plt.figure(figsize=(FIGSIZE[0], 0.6 + 0.24 * (row + 1)), dpi=DPI)   # 96 monospace chars of 10 pt fit 9 in
    ax = fig.add_axes((0.02, 0.02, 0.96, 1 - 0.4 / fig.get_figheight()))
    for x, y, part, color in placed:
        box = dict(facecolor=color, edgecolor="none", pad=0.6) if color else None
        ax.text(x, y, part, family="monospace", fontsize=fontsize, va="center", bbox=box)
    ax.set_xlim(0, chars)
    ax.set_ylim(row + 0.6, -0.6)
    ax.axis("off")
    ax.set_title(title)
    return fig


def interact(fn, **controls) -> None:
    """``ipywidgets.interact(fn, **controls)`` that also saves a static picture of ``fn``'s first
    state, so the cell shows a figure on GitHub and before the kernel runs; ``fn`` draws once per
    state (``tplab.interactive``)."""
    from tplab.interactive import interact as show    # ipywidgets only where a widget is shown
    show(fn, **controls)
