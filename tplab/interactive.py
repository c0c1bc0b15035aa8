"""Widgets that read well before anything runs: ``plotting.interact(fn, **controls)``.

A saved ``ipywidgets.interact`` output is only a reference to a live widget. GitHub, and JupyterLab
before the notebook is trusted or run, show its text fallback instead:
``interactive(children=(IntSlider(value=1, ...``. ``interact`` draws ``fn``'s first state once and
puts it in two places: inside the live widget, and as a plain PNG (or the printed text) in the same
output's bundle. A viewer that can run the widget shows the widget; any other shows the picture.
"""
import base64
import io
import traceback
from contextlib import redirect_stdout
from unittest import mock

import ipywidgets
import matplotlib.pyplot as plt
from IPython.display import display

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _png(fig) -> dict:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=fig.dpi, bbox_inches="tight")   # as the inline backend draws it
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": base64.b64encode(buf.getvalue()).decode(), "text/plain": repr(fig)}}


def render(fn, kwargs: dict) -> list[dict]:
    """Call ``fn(**kwargs)`` once and return what it showed, as nbformat outputs: its printed text,
    then one PNG per figure it drew (shown with ``plt.show()`` or left open). Its figures are closed."""
    before, pictures = set(plt.get_fignums()), []

    def snapshot(*_, **__):                      # plt.show() inside fn: keep the picture, show nothing
        for num in sorted(set(plt.get_fignums()) - before):
            fig = plt.figure(num)
            pictures.append(_png(fig))
            plt.close(fig)

    text = io.StringIO()
    with redirect_stdout(text), mock.patch.object(plt, "show", snapshot):
        try:
            fn(**kwargs)
        finally:
            snapshot()                           # figures fn left open
    printed = [{"output_type": "stream", "name": "stdout", "text": text.getvalue()}] if text.getvalue() else []
    return printed + pictures


def static_bundle(outputs: list[dict], caption: str) -> dict:
    """The picture a viewer without the live widget shows: the first PNG, else the printed text
    (``caption``, e.g. ``show_step(step=23)``, stands in for a figure where only text is shown)."""
    text = "".join(o["text"] for o in outputs if o["output_type"] == "stream")
    png = next((o["data"]["image/png"] for o in outputs if "image/png" in o.get("data", {})), None)
    if png is None:
        return {"text/plain": text or f"{caption}: no output"}
    return {"image/png": png, "text/plain": text or f"<figure: {caption}>"}


class PictureInteractive(ipywidgets.interactive):
    """``ipywidgets.interactive`` whose every state is drawn once, by ``render``, into its output
    widget, and whose display bundle also carries its first state as a static picture."""

    def __init__(self, fn, **controls):
        self.first = None
        super().__init__(fn, {}, **controls)    # calls update() once: the first state

    def update(self, *args):
        self.kwargs = {w._kwarg: w.get_interact_value() for w in self.kwargs_widgets}
        try:
            outputs = render(self.f, self.kwargs)
        except Exception:
            if self.first is None:
                raise                            # a broken first state fails the cell, and nbval with it
            outputs = [{"output_type": "stream", "name": "stderr", "text": traceback.format_exc()}]
        if self.first is None:
            self.first, self.first_kwargs = outputs, dict(self.kwargs)
            self.visible = {w._kwarg for w in self.kwargs_widgets if isinstance(w, ipywidgets.DOMWidget)}
        self.out.outputs = tuple(outputs)

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)
        if WIDGET_VIEW not in bundle:
            return bundle
        first = ", ".join(f"{k}={v!r}" for k, v in self.first_kwargs.items() if k in self.visible)
        return {**bundle, **static_bundle(self.first, f"{getattr(self.f, '__name__', 'fn')}({first})")}


def interact(fn, **controls) -> None:
    """Show ``fn`` with live controls, like ``ipywidgets.interact(fn, **controls)``, plus a static
    picture of its first state for GitHub and an unrun notebook. ``fn`` draws once per state.

    ``controls`` are what ``ipywidgets.interact`` takes (widgets, ``ipywidgets.fixed``, ranges,
    lists). Returns None, so a cell ending in this call shows the widget once.
    """
    display(PictureInteractive(fn, **controls))
