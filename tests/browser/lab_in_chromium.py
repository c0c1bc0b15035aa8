"""The workbook in a real browser: ``./workbook.sh lab`` opened in headless Chromium.

Run by ``./workbook.sh test-browser`` (which installs Chromium, its driver and Selenium first), not by
``./workbook.sh test``: the file name keeps pytest from collecting it with the rest of ``tests/``.

- the lab starts (as root where CI runs as root), answers over HTTP and lands in ``notebooks/``;
- every notebook opens with no widget shown as text (``interactive(children=(IntSlider(...``), the
  saved picture of each widget cell shown, and no "modified" mark once its kernel has started;
- notebook 01 runs from the UI (Run > Run All Cells) to its "all checks held" line, and moving
  its slider redraws the plot;
- no notebook file changes on disk. Screenshots go to ``tests/browser/screenshots/`` (ignored by git).
"""
import hashlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SHOTS = Path(__file__).resolve().parent / "screenshots"
WIDGET_AS_TEXT = re.compile(r"\b(interactive|VBox|HBox|IntSlider|FloatSlider|Dropdown|Text|Output)\(|"
                            r"Error displaying widget|Loading widget")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, token: str, method: str = "GET"):
    req = urllib.request.Request(url, method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.geturl(), r.read()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """``./workbook.sh lab`` on a free port with its own settings (autosave off: a test never writes a
    notebook); always stopped, kernels included."""
    settings = tmp_path_factory.mktemp("lab-settings")
    docmanager = settings / "@jupyterlab" / "docmanager-extension"
    docmanager.mkdir(parents=True)
    (docmanager / "plugin.jupyterlab-settings").write_text('{"autosave": false}')
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path_factory.mktemp("lab-workspaces"))}
    log = open(tmp_path_factory.mktemp("lab-log") / "lab.log", "w")
    proc = subprocess.Popen([str(ROOT / "workbook.sh"), "lab", "--no-browser", f"--port={port}",
                             "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            if proc.poll() is not None:
                raise RuntimeError(f"the lab exited with {proc.returncode}: {Path(log.name).read_text()[-2000:]}")
            try:
                get(f"{url}/api/status", token)
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError("the lab did not answer within 60 s")
        yield url, token
    finally:
        os.killpg(proc.pid, signal.SIGTERM)      # the server stops its kernels on SIGTERM
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def browser(lab):
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    options.binary_location = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    driver = webdriver.Chrome(service=Service(os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")),
                              options=options)
    driver.set_script_timeout(30)
    SHOTS.mkdir(exist_ok=True)
    yield driver
    driver.quit()


@pytest.fixture(autouse=True)
def one_kernel_at_a_time(request):
    """Every kernel a test started is shut down after it, passed or failed."""
    yield
    if "lab" in request.fixturenames:
        shut_down_kernels(*request.getfixturevalue("lab"))


@pytest.fixture(scope="module")
def on_disk():
    """The notebooks' bytes before any test: nothing here may change them."""
    digest = {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in NOTEBOOKS}
    yield digest
    after = {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in NOTEBOOKS}
    assert after == digest, "a notebook file changed on disk during the browser test"


def wait_for(condition, timeout: float, what: str, every: float = 0.5):
    end = time.time() + timeout
    while time.time() < end:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def kernel_idle(d) -> bool:
    return "| Idle" in d.execute_script(
        "return [...document.querySelectorAll('.jp-StatusBar-Widget')].map(e => e.innerText).join(' ')")


def dirty_tabs(d) -> list:
    return d.execute_script("return [...document.querySelectorAll('.lm-TabBar-tab.jp-mod-dirty')]"
                            ".map(e => e.innerText)")


CELLS_JS = """
const out = {};
for (const c of document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell')) {
  const outputs = [...c.querySelectorAll('.jp-OutputArea-output')];
  out[c.dataset.windowedListIndex] = {
    text: outputs.map(o => o.innerText).join('\\n'),
    images: c.querySelectorAll('.jp-OutputArea-output img').length,
  };
}
return out;"""


def sweep(d) -> dict:
    """Scroll the notebook from top to bottom (JupyterLab keeps only cells near the view in the page)
    and return what each cell's outputs show, by cell index."""
    seen, bottom_hits = {}, 0
    d.execute_script("document.querySelector('.jp-WindowedPanel-outer').scrollTop = 0")
    while bottom_hits < 2:
        time.sleep(0.5)
        for k, v in d.execute_script(CELLS_JS).items():    # keep the fullest view of each cell
            old = seen.get(int(k))
            if old is None or (v["images"], len(v["text"])) > (old["images"], len(old["text"])):
                seen[int(k)] = v
        at_bottom = d.execute_script("""const s = document.querySelector('.jp-WindowedPanel-outer');
            const end = s.scrollTop + s.clientHeight >= s.scrollHeight - 2; s.scrollTop += s.clientHeight * 0.8;
            return end;""")
        bottom_hits += bool(at_bottom)
    return seen


def open_notebook(d, lab, path: Path):
    url, token = lab
    d.get(f"{url}/lab/tree/notebooks/{path.name}?reset&token={token}")     # ?reset: only this notebook open
    wait_for(lambda: d.execute_script("return document.querySelectorAll('.jp-Notebook .jp-Cell').length"),
             60, f"{path.name} to render (page title: {d.title!r})")
    wait_for(lambda: kernel_idle(d), 60, f"{path.name}'s kernel to start")


def shut_down_kernels(url: str, token: str):
    for session in json.loads(get(f"{url}/api/sessions", token)[2]):
        get(f"{url}/api/sessions/{session['id']}", token, method="DELETE")


def scroll_to_cell(d, index: int, block: str = "start"):
    """Scroll until cell ``index`` is in the page, then into view; return its element."""
    for _ in range(200):
        cell = d.execute_script(f"""return document.querySelector(
            '.jp-Notebook .jp-Cell[data-windowed-list-index="{index}"]')""")
        if cell is not None:
            d.execute_script(f"arguments[0].scrollIntoView({{block: '{block}'}})", cell)
            time.sleep(0.5)
            return cell
        d.execute_script("document.querySelector('.jp-WindowedPanel-outer').scrollTop += 600")
        time.sleep(0.2)
    raise AssertionError(f"cell {index} never came into the page")


def test_lab_answers_and_opens_on_the_notebooks(lab):
    url, token = lab
    status, landed, _ = get(f"{url}/", token)
    assert status == 200 and landed.endswith("/lab/tree/notebooks"), landed
    listing = json.loads(get(f"{url}/api/contents/", token)[2])
    names = {item["name"] for item in listing["content"]}
    assert {"notebooks", "tplab", "README.md"} <= names, f"the lab does not serve the repository root: {names}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_opens_clean_and_reads_well(lab, browser, on_disk, path):
    saved = json.loads(path.read_text())["cells"]
    open_notebook(browser, lab, path)
    browser.save_screenshot(str(SHOTS / f"{path.stem}-opened.png"))
    seen = sweep(browser)
    assert len(seen) == len(saved), f"saw {len(seen)} of {len(saved)} cells"
    as_text = {i: cell["text"][:120] for i, cell in seen.items() if WIDGET_AS_TEXT.search(cell["text"])}
    assert not as_text, f"widgets shown as text in {path.name}: {as_text}"
    for i, cell in enumerate(saved):            # a widget cell shows its saved picture (or text)
        widgets = [o for o in cell.get("outputs", []) if WIDGET_VIEW in o.get("data", {})]
        if not widgets:
            continue
        if any("image/png" in o["data"] for o in widgets):
            assert seen[i]["images"] >= 1, f"cell {i} of {path.name}: its widget's saved picture is not shown"
        else:
            assert seen[i]["text"].strip(), f"cell {i} of {path.name}: its widget shows nothing before it runs"
        scroll_to_cell(browser, i)
        browser.save_screenshot(str(SHOTS / f"{path.stem}-widget-cell{i}.png"))
    time.sleep(2)                                # the kernel's info has long arrived: JupyterLab rewrote what it would
    assert not dirty_tabs(browser), f"{path.name} is marked modified right after opening"


def run_all(d):
    d.find_element(By.XPATH, "//div[contains(@class,'lm-MenuBar-itemLabel') and text()='Run']").click()
    d.find_element(By.XPATH, "//div[contains(@class,'lm-Menu-itemLabel') and text()='Run All Cells']").click()


def widget_image(d, index: int) -> str:
    """The src of the first picture in cell ``index``'s widget output, or "" if none is shown.

    Read in one script call: a redraw replaces the <img>, so an element handle kept between
    two WebDriver calls can go stale under a slider move."""
    return d.execute_script(f"""const img = document.querySelector(
        '.jp-Notebook .jp-Cell[data-windowed-list-index="{index}"] '
        + ':is(.widget-output, .jupyter-widgets-output-area) img');
        return img ? img.src : '';""")


def test_notebook_01_runs_from_the_ui_and_its_slider_redraws(lab, browser, on_disk):
    path = ROOT / "notebooks" / "01_causal_mask_nan.ipynb"
    saved = json.loads(path.read_text())["cells"]
    slider_cell = next(i for i, c in enumerate(saved) if "plotting.interact(" in "".join(c["source"]))
    open_notebook(browser, lab, path)
    run_all(browser)

    def checks_held():
        browser.execute_script("const s = document.querySelector('.jp-WindowedPanel-outer'); s.scrollTop = s.scrollHeight")
        texts = browser.execute_script(CELLS_JS).values()
        return any(re.search(r"all \d+ checks held", t["text"]) for t in texts)
    wait_for(checks_held, 300, "notebook 01 to print 'all N checks held' after Run All", every=2)
    scroll_to_cell(browser, len(saved) - 1, block="end")
    browser.save_screenshot(str(SHOTS / "01-run-all-done.png"))

    scroll_to_cell(browser, slider_cell)
    before = wait_for(lambda: widget_image(browser, slider_cell), 30, "the live widget's plot")
    browser.save_screenshot(str(SHOTS / "01-slider-before.png"))
    handle = scroll_to_cell(browser, slider_cell).find_element(By.CSS_SELECTOR, ".widget-hslider .noUi-handle")
    handle.send_keys(Keys.ARROW_LEFT)           # layer 1 -> 0
    wait_for(lambda: widget_image(browser, slider_cell) not in ("", before), 60,
             "the plot to change after moving the slider")
    browser.save_screenshot(str(SHOTS / "01-slider-after.png"))
