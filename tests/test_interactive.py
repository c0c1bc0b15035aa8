"""plotting.interact: the live widget and a static picture of its first state, drawn once; and the token figure."""
import matplotlib
import matplotlib.pyplot as plt
import ipywidgets
import pytest

from tplab import plotting
from tplab.interactive import WIDGET_VIEW, PictureInteractive, render

matplotlib.use("Agg")


def draw(step, calls):
    calls.append(step)
    fig, ax = plt.subplots(figsize=(2, 1), dpi=50)
    ax.plot([0, step], [0, step])
    plt.show()
    plt.close(fig)


def test_render_keeps_text_and_figures_and_closes_them():
    def fn(n):
        print(f"n = {n}")
        plt.subplots(figsize=(2, 1), dpi=50)      # shown with plt.show()
        plt.show()
        plt.subplots(figsize=(2, 1), dpi=50)      # left open
    open_before = plt.get_fignums()
    outputs = render(fn, {"n": 3})
    assert [o["output_type"] for o in outputs] == ["stream", "display_data", "display_data"]
    assert outputs[0]["text"] == "n = 3\n"
    assert all(o["data"]["image/png"].startswith("iVBOR") for o in outputs[1:])    # base64 of a PNG
    assert plt.get_fignums() == open_before


def test_first_state_is_drawn_once_and_saved_as_a_picture():
    calls = []
    w = PictureInteractive(draw, step=ipywidgets.IntSlider(value=2, max=5), calls=ipywidgets.fixed(calls))
    assert calls == [2]
    bundle = w._repr_mimebundle_()
    assert WIDGET_VIEW in bundle and bundle["image/png"] == w.first[0]["data"]["image/png"]
    assert list(w.out.outputs) == w.first                     # the live widget shows the same drawing
    assert bundle["text/plain"] == "<figure: draw(step=2)>"                 # for text-only viewers


def test_moving_a_control_redraws_the_widget_not_the_picture():
    calls = []
    w = PictureInteractive(draw, step=ipywidgets.IntSlider(value=2, max=5), calls=ipywidgets.fixed(calls))
    first_png = w._repr_mimebundle_()["image/png"]
    w.kwargs_widgets[0].value = 4
    assert calls == [2, 4]
    assert w.out.outputs[0]["data"]["image/png"] != first_png
    assert w._repr_mimebundle_()["image/png"] == first_png


def test_printed_text_is_the_picture_when_nothing_is_drawn():
    w = PictureInteractive(lambda k: print(f"top {k}"), k=ipywidgets.Dropdown(options=[1, 5], value=5))
    bundle = w._repr_mimebundle_()
    assert bundle["text/plain"] == "top 5\n" and "image/png" not in bundle


def test_a_broken_first_state_fails_the_cell_later_ones_show_the_error():
    def fn(x):
        if x != 1:
            raise ValueError(f"bad x {x}")
    with pytest.raises(ValueError, match="bad x 0"):
        PictureInteractive(fn, x=ipywidgets.IntSlider(value=0))
    w = PictureInteractive(fn, x=ipywidgets.IntSlider(value=1))
    w.kwargs_widgets[0].value = 2
    assert w.out.outputs[0]["name"] == "stderr" and "bad x 2" in w.out.outputs[0]["text"]


def test_token_figure_wraps_lines_and_colours_each_piece():
    from matplotlib.colors import to_rgba
    fig = plotting.token_figure(["ab", "cd\nef", "g" * 7, "h"], [None, "red", "green", None], "t", chars=8)
    ax = fig.axes[0]
    placed = [(t.get_position(), t.get_text(), t.get_bbox_patch()) for t in ax.texts]
    assert [(pos, text) for pos, text, _ in placed] == [
        ((0, 0), "ab"), ((2, 0), "cd"), ((0, 1), "ef"),   # the newline inside a piece starts a line
        ((0, 2), "ggggggg"), ((7, 2), "h")]                # 2 + 7 > 8 characters: a new line; 7 + 1 fits
    assert [box.get_facecolor() if box else None for *_, box in placed] == [
        None, to_rgba("red"), to_rgba("red"), to_rgba("green"), None]
    plt.close(fig)
    with pytest.raises(ValueError, match="one colour per piece: got 2 pieces and 1 colours"):
        plotting.token_figure(["a", "b"], [None], "t")


def _texts(fig):
    """Every visible text of a drawn figure: tick labels, labels, titles, legends, annotations."""
    fig.canvas.draw()
    return [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text()]


def test_plotting_figures_read_at_100_percent_zoom():
    from tplab.golden import Diff
    rows = [Diff(f"model.layers.{i}.mlp", 10.0 ** -i, 0, 1e-4) for i in range(6)]
    figs = [plotting.plot_layer_diffs({"a": rows, "b": rows}), plotting.token_figure(["x"] * 3, [None] * 3, "t")]
    fig, ax = plotting.figure(2)
    ax[0].plot([1, 2], label="line"), ax[0].legend(), ax[1].set_title("t"), ax[1].text(0, 0, "note")
    for f in [*figs, fig]:
        width_px = f.get_figwidth() * f.dpi
        assert 800 <= width_px <= 1000, width_px                            # a notebook's output width
        small = [(t.get_text(), t.get_fontsize()) for t in _texts(f) if t.get_fontsize() < 9]
        assert not small, small
        plt.close(f)


def test_notebooks_draw_through_plotting_with_no_smaller_text():
    import re
    from pathlib import Path

    import nbformat
    found = []
    for path in sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "code":
                continue
            assert not re.search(r"plt\.(subplots|figure)\(|figsize=", cell.source), (path.name, cell.source)
            sizes = [float(s) for s in re.findall(r"fontsize=(\d+(?:\.\d+)?)", cell.source)]
            assert all(s >= 9 for s in sizes), (path.name, sizes)
            widths = [float(w) for w in re.findall(r"plotting\.figure\((?:ncols=)?\w+(?:\([^)]*\))?, "
                                                   r"(?:width=)?(\d+(?:\.\d+)?)", cell.source)]
            assert all(8 <= w <= 10 for w in widths), (path.name, widths)
            found += widths
    assert len(found) >= 10, found                                   # the pattern does find the call sites


def test_committed_notebooks_stay_well_under_1_mb():
    from pathlib import Path
    sizes = {p.name: p.stat().st_size for p in (Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb")}
    assert sizes and max(sizes.values()) < 800_000, sizes       # 9-inch figures at 100 dpi: about 480 KB at most
