"""`make lab` in a real browser: JupyterLab started by scripts/lab.sh, driven by Playwright in Debian's headless Chromium
as an attendee drives it: it opens on 00_setup with the `tutorial` kernel and no news pop-up, Run > Run All Cells
shows the engines' table and the all-reduce, TensorBoard opens under the lab's URL on the lab's runs/ (behind its
login), Interrupt during a training run stops the engines' run too, a closed tab leaves no engine (the lab culls its
kernel), and stopping the lab leaves no process (TensorBoard's included) and no browser.

The lab serves a copy of notebooks/ in a temporary folder: notebooks/00_setup.ipynb (its stored outputs are what strict
nbval compares) is never saved over. Needs /usr/bin/chromium and the playwright wheel (scripts/install.sh installs both
as root; Playwright never downloads a browser here); without them the test is skipped with one line saying why.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from conftest import type_cell

from tutorial.core.process import free_port
from tutorial.launch import child_processes

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
KERNEL = Path(sys.prefix) / "share" / "jupyter" / "kernels" / "tutorial" / "kernel.json"
FIRST = "00_setup.ipynb"
BUDGET_S = 180  # the whole test, lab start to nothing left
CULL_S = 10  # the lab stops a kernel no tab is connected to after this many idle seconds (make lab: an hour)


def missing() -> str:
    if not os.access(CHROMIUM, os.X_OK):
        return "chromium not installed (apt-get install chromium; scripts/install.sh does it as root)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright wheel is not installed (make install)"
    if not KERNEL.is_file():
        return "the Jupyter kernel 'tutorial' is not registered in this venv (make install)"
    return ""


pytestmark = pytest.mark.skipif(bool(missing()), reason=missing() or "ready")


class Lab:
    """scripts/lab.sh on a free port with a token, serving `root`, with its own Jupyter runtime, settings and
    workspace folders; every process it starts carries `tag`."""

    def __init__(self, root: Path, home: Path, tag: str):
        self.port, self.token, self.tag = free_port(), os.urandom(12).hex(), tag
        env = dict(os.environ, VENV=sys.prefix, LAB_ROOT=str(root), JUPYTER_TOKEN=self.token,
                   JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"), LAB_CULL_S=str(CULL_S), **{child_processes.TAG_VARIABLE: tag})
        self.log = open(home / "lab.log", "w")
        self.proc = subprocess.Popen(["bash", "scripts/lab.sh", "127.0.0.1", str(self.port)], cwd=ROOT, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(f"the lab did not start:\n{(home / 'lab.log').read_text()}")
                time.sleep(0.5)

    def stop(self) -> float:
        """Stop the lab as Ctrl-C twice or a closed terminal does (SIGTERM): it shuts its kernels down, and their
        reapers stop their engines. Returns the seconds until no process of the lab was left (at most 30)."""
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        while child_processes.leftovers(self.tag) and time.monotonic() - start < 30:
            time.sleep(0.2)
        return time.monotonic() - start


def text_of(page, selector: str) -> list[str]:
    return page.locator(selector).all_inner_texts()


def wait_idle(page, timeout_s: float) -> None:
    """Until no cell waits or runs ([*]) and the kernel is idle."""
    page.wait_for_function(
        """() => ![...document.querySelectorAll('.jp-InputPrompt')].some(p => p.innerText.includes('*'))""",
        timeout=timeout_s * 1000)


def test_make_lab_runs_00_setup_through_the_ui_interrupts_and_leaves_nothing(tmp_path):
    from playwright.sync_api import sync_playwright
    start = time.monotonic()
    root, home = tmp_path / "notebooks", tmp_path / "home"
    home.mkdir()
    shutil.copytree(ROOT / "notebooks", root, ignore=shutil.ignore_patterns("runs", ".ipynb_checkpoints"))
    from torch.utils.tensorboard import SummaryWriter  # a run's event files, where a trainer's --out runs/... puts them
    with SummaryWriter(str(root / "runs" / "01_single" / "tb")) as writer:
        for step in range(3):
            writer.add_scalar("loss/train", 2.3 / (step + 1), step)
    original = (ROOT / "notebooks" / FIRST).read_bytes()
    # The test's own settings: every cell stays in the page (JupyterLab renders only the cells in view by default),
    # so that the outputs of the whole notebook can be read.
    tracker = home / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text('{"windowingMode": "none"}\n')
    tag = child_processes.new_tag()
    lab = Lab(root, home, tag)
    profile = tmp_path / "chromium-profile"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch_persistent_context(
                str(profile), executable_path=CHROMIUM, headless=True, viewport={"width": 1400, "height": 900},
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
                      "--disable-component-update", "--disable-sync"])
            try:
                page = browser.pages[0] if browser.pages else browser.new_page()
                page.set_default_timeout(60_000)
                try:
                    drive(page, lab)
                except Exception:
                    page.screenshot(path=str(tmp_path / "failed.png"))
                    print(f"screenshot: {tmp_path / 'failed.png'}; lab log: {home / 'lab.log'}")
                    raise
            finally:
                browser.close()
    finally:
        seconds = lab.stop()
    left = child_processes.leftovers(tag)
    child_processes.stop(left)
    assert not left, f"left running after the lab stopped: {left}"
    print(f"lab stopped: nothing left after {seconds:.1f} s")
    browsers = [q.pid for q in psutil.process_iter(["cmdline"]) if str(profile) in " ".join(q.info["cmdline"] or [])]
    assert not browsers, f"chromium processes left: {browsers}"
    assert (ROOT / "notebooks" / FIRST).read_bytes() == original  # the course's notebook was not saved over
    assert time.monotonic() - start < BUDGET_S


def drive(page, lab: Lab) -> None:
    # The lab's own address, as scripts/lab.sh prints it, opens on the first notebook.
    page.goto(f"{lab.url}/?token={lab.token}")
    page.wait_for_selector(f'.jp-NotebookPanel .jp-Notebook .jp-Cell')
    assert page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current").inner_text().strip() == FIRST
    listing = [t.strip() for t in text_of(page, ".jp-DirListing-item .jp-DirListing-itemText")]
    files = [name for name in listing if "." in name]  # JupyterLab lists folders (capstone/) before files
    assert files[:2] == [FIRST, "01_single_device.ipynb"], listing
    # The notebook's kernel starts without a "Select Kernel" dialog.
    page.wait_for_function("() => document.body.innerText.includes('Python (distributed tutorial) | Idle')",
                           timeout=90_000)
    assert page.locator(".jp-Dialog").count() == 0
    # Run > Run All Cells, as in the menu.
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    page.wait_for_timeout(2000)
    wait_idle(page, 120)
    outputs = "\n".join(text_of(page, ".jp-NotebookPanel .jp-OutputArea-output"))
    assert "rank  local  host  pid" in outputs and "threads" in outputs, outputs[-3000:]  # the engines' table
    assert "rank 0: mine 0, sum 1, expected 1" in outputs and "rank 1: mine 1, sum 1, expected 1" in outputs
    assert "no engine, controller or mpiexec left: True" in outputs
    # No news pop-up at any time (JupyterLab asks a few seconds after it opens).
    assert "official Jupyter news" not in page.locator("body").inner_text()
    tensorboard_in_the_lab(page, lab)
    # A training run, then Interrupt (the toolbar's button): the engines stop at a step, the next cell runs at once.
    type_cell(page, "import tutorial.train_ddp as t; c = engines.start(n=2, show=False); "
                    "c.run(t.main, cfg.replace(epochs=400))")
    page.wait_for_function("() => document.body.innerText.includes('epoch 1:')", timeout=120_000)
    interrupted = time.monotonic()
    page.locator('.jp-NotebookPanel-toolbar [data-command="notebook:interrupt-kernel"]').first.click()
    page.wait_for_function("() => document.body.innerText.includes('stopped on all 2 ranks at step')",
                           timeout=30_000)
    print(f"Interrupt -> its line after {time.monotonic() - interrupted:.1f} s")
    assert "official Jupyter news" not in page.locator("body").inner_text()
    # The tab closed with the engines running: the lab stops the kernel no tab is connected to (LAB_CULL_S), and
    # the kernel's reaper its engines.
    assert engines_of(lab.tag)
    page.close()
    closed = time.monotonic()
    while engines_of(lab.tag) and time.monotonic() - closed < 60:
        time.sleep(0.5)
    assert not engines_of(lab.tag), "the engines outlived the closed tab"
    print(f"tab closed -> no engine after {time.monotonic() - closed:.1f} s (LAB_CULL_S={CULL_S})")


def tensorboard_in_the_lab(page, lab: Lab) -> None:
    """TensorBoard under the lab's URL (jupyter-server-proxy, scripts/lab_settings.py): a tile in the launcher, its
    page in this browser showing the lab's runs/, and nothing without the lab's login."""
    servers = json.load(urllib.request.urlopen(f"{lab.url}/server-proxy/servers-info?token={lab.token}", timeout=30))
    assert [s["launcher_entry"]["title"] for s in servers["server_processes"]] == ["TensorBoard (runs/)"], servers
    board = page.context.new_page()
    try:
        started = time.monotonic()
        board.goto(f"{lab.url}/tensorboard/")  # the browser's lab cookie is its login
        # the run, and its tag's card (TensorBoard sets "loss" and "/train" apart)
        board.wait_for_function("() => document.body.innerText.includes('01_single/tb') && "
                                "document.body.innerText.includes('/train')", timeout=90_000)
        print(f"TensorBoard in the lab: its scalars after {time.monotonic() - started:.1f} s")
    finally:
        board.close()
    request = urllib.request.Request(f"{lab.url}/tensorboard/data/runs")  # no login: the lab's login page
    opener = urllib.request.build_opener(NoRedirect)
    try:
        opener.open(request, timeout=30)
        answer = (200, "")
    except urllib.error.HTTPError as err:
        answer = (err.code, err.headers.get("Location", "").split("?")[0])
    assert answer == (302, "/login"), answer


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def engines_of(tag: str) -> list[dict]:
    return [p for p in child_processes.leftovers(tag, child_processes.PROCESS_NAMES) if not p["zombie"]]
