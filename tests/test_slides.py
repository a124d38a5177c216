"""`make slides`: every deck opens offline in headless Chromium, every slide fits the screen, speaker notes are there.

The decks are built once, with scripts/slides.sh (what `make slides` runs after `make install`), into slides/. Each is
then opened from the file system in Debian's `chromium`, driven by playwright, with every http(s) and websocket
request refused and recorded: a workshop room's Wi-Fi is no dependency. Needs chromium (scripts/install.sh installs
it as root) and npm (for reveal.js, once); without them the tests are skipped, except under CI=true, where a skip
would hide that the decks were never rendered.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLIDES = ROOT / "slides"
NOTES = SLIDES / "notes"
NOTEBOOKS = sorted(ROOT.glob("notebooks/[0-9][0-9]*_*.ipynb"))
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
VENDOR = SLIDES / "vendor" / "node_modules" / "reveal.js" / "dist" / "reveal.js"
# Speaker notes are written by hand for every notebook (slides/notes/<notebook>.md); a new notebook needs its own.
NOTES_REQUIRED = [nb.stem for nb in NOTEBOOKS]
VIEWPORT = {"width": 1280, "height": 720}


def missing() -> str:
    if not os.access(CHROMIUM, os.X_OK):
        return "chromium not installed (apt-get install chromium; scripts/install.sh does it as root)"
    if not VENDOR.is_file() and shutil.which("npm") is None:
        return "npm not installed, so reveal.js cannot be fetched (apt-get install nodejs npm)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright wheel is not installed (make install)"
    return ""


if missing():
    if os.environ.get("CI"):
        pytest.fail(f"CI must render the slides: {missing()}", pytrace=False)
    pytest.skip(missing(), allow_module_level=True)

from playwright.sync_api import sync_playwright  # noqa: E402


@pytest.fixture(scope="module")
def build():
    """scripts/slides.sh, as `make slides` runs it; returns its stderr (warnings about notes)."""
    env = dict(os.environ, VENV=sys.prefix)
    proc = subprocess.run(["bash", "scripts/slides.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"scripts/slides.sh failed:\n{proc.stdout}\n{proc.stderr}"
    for nb in NOTEBOOKS:
        assert (SLIDES / f"{nb.stem}.slides.html").is_file(), f"no deck for {nb.name}:\n{proc.stdout}"
    return proc.stderr


@pytest.fixture(scope="module")
def browser(build):
    with sync_playwright() as p:
        # The flags keep Chromium's own background traffic (updates, sync) from knocking on a closed network.
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"])
        try:
            yield b
        finally:
            b.close()  # no chromium process outlives the tests


class Deck:
    """One deck open in a fresh browser context that refuses, and records, every request off this machine."""

    def __init__(self, browser, stem: str):
        self.context = browser.new_context(viewport=VIEWPORT)
        self.external, self.failed, self.errors = [], [], []
        self.context.route(re.compile(r"^(https?|wss?)://"), self._refuse)
        self.page = self.context.new_page()
        self.page.on("requestfailed", lambda r: self.failed.append(r.url))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.goto((SLIDES / f"{stem}.slides.html").as_uri())
        # Ready: reveal.js initialised, and the fitting script has split or marked the slides too tall for the screen.
        self.page.wait_for_function(
            "() => window.Reveal && Reveal.isReady() && document.documentElement.dataset.slidesFitted === 'true'",
            timeout=60_000)
        self.page.evaluate("() => Reveal.configure({transition: 'none', backgroundTransition: 'none'})")

    def _refuse(self, route):
        self.external.append(route.request.url)
        route.abort()

    def close(self):
        self.context.close()


@pytest.fixture(scope="module", params=[nb.stem for nb in NOTEBOOKS])
def deck(request, browser):
    """One deck, opened once for all the tests below."""
    d = Deck(browser, request.param)
    yield request.param, d
    d.close()


# Every vertical slide, shown in turn, as a person would page through the deck, measured where it is drawn.
MEASURE = """() => {
  const out = [];
  for (const s of document.querySelectorAll('.reveal .slides > section > section')) {
    const i = Reveal.getIndices(s);
    Reveal.slide(i.h, i.v);
    const r = s.getBoundingClientRect(), style = getComputedStyle(s);
    const sideways = Array.from(s.querySelectorAll('*')).filter(e => e.scrollWidth > e.clientWidth + 1
      && e.clientWidth > 0 && ['auto', 'scroll', 'hidden'].includes(getComputedStyle(e).overflowX)).length;
    out.push({h: i.h, v: i.v, top: r.top, bottom: r.bottom, left: r.left, right: r.right,
              scrollHeight: s.scrollHeight, clientHeight: s.clientHeight, scrollWidth: s.scrollWidth,
              clientWidth: s.clientWidth, scrolls: s.classList.contains('fit-scroll'), overflowY: style.overflowY,
              sideways, notes: (Reveal.getSlideNotes(s) || '').trim().length,
              text: (s.innerText || '').trim().replace(/\\s+/g, ' ').slice(0, 60)});
  }
  return out;
}"""


def test_deck_loads_offline(deck):
    stem, d = deck
    assert d.page.evaluate("() => Reveal.getTotalSlides()") > 1, f"{stem}: the deck has a single slide"
    assert not d.external, f"{stem}: requests left the machine: {sorted(set(d.external))}"
    assert not d.failed, f"{stem}: files the deck needs are missing: {sorted(set(d.failed))}"
    assert not d.errors, f"{stem}: errors in the page: {d.errors[:5]}"


def test_every_slide_fits_the_screen(deck):
    stem, d = deck
    slides = d.page.evaluate(MEASURE)
    width, height = VIEWPORT["width"], VIEWPORT["height"]
    bad = []
    for s in slides:
        on_screen = s["top"] >= -1 and s["left"] >= -1 and s["bottom"] <= height + 1 and s["right"] <= width + 1
        # Content taller than the slide is fine only on a slide that deliberately scrolls.
        fits = s["scrollHeight"] <= s["clientHeight"] + 1 or (s["scrolls"] and s["overflowY"] in ("auto", "scroll"))
        if not (on_screen and fits and s["scrollWidth"] <= s["clientWidth"] + 1 and not s["sideways"]):
            bad.append(s)
    assert not bad, f"{stem}: {len(bad)} of {len(slides)} slides do not fit {width}x{height}:\n" + "\n".join(
        f"  slide {s['h']}/{s['v']} '{s['text']}': content {s['scrollHeight']} px in {s['clientHeight']}, "
        f"drawn from y={s['top']:.0f} to {s['bottom']:.0f}, {s['sideways']} element(s) cut sideways" for s in bad)
    scrolling = [s for s in slides if s["scrolls"]]
    # Scrolling is the exception (a single cell taller than a slide), not the way decks fit.
    assert len(scrolling) <= max(2, len(slides) // 5), f"{stem}: {len(scrolling)} of {len(slides)} slides scroll"


# A slide appended to the first stack of a deck, with cells of the given heights, then fitted as at load time.
ADD_SLIDE = """(heights) => {
  const stack = document.querySelector('.reveal .slides > section');
  const slide = document.createElement('section');
  slide.id = 'added';
  heights.forEach((h, k) => {
    const cell = document.createElement('div');
    cell.className = 'jp-Cell jp-MarkdownCell';
    cell.style.height = h + 'px';
    cell.textContent = 'cell ' + k;
    slide.appendChild(cell);
  });
  stack.appendChild(slide);
  Reveal.sync();
  fitSlides(Reveal);
  const pieces = [slide];
  for (let s = slide.nextElementSibling; s && s.classList.contains('fit-piece'); s = s.nextElementSibling) {
    pieces.push(s);
  }
  return pieces.map(p => {
    const i = Reveal.getIndices(p);
    Reveal.slide(i.h, i.v);
    return {h: i.h, v: i.v, cells: p.querySelectorAll('.jp-Cell').length,
            label: (p.querySelector('.fit-continued') || {}).textContent || '',
            scrolls: p.classList.contains('fit-scroll'), fits: p.scrollHeight <= p.clientHeight + 1};
  });
}"""


@pytest.fixture
def first_deck(browser):
    d = Deck(browser, NOTEBOOKS[0].stem)
    yield d
    d.close()


def test_long_slide_is_split_into_sub_slides(first_deck):
    pieces = first_deck.page.evaluate(ADD_SLIDE, [250] * 6)  # 1500 px of cells on a 720 px slide
    assert [p["cells"] for p in pieces] == [2, 2, 2], pieces
    assert all(p["fits"] and not p["scrolls"] for p in pieces), pieces
    assert [p["label"][-5:] for p in pieces[1:]] == ["(2/3)", "(3/3)"], pieces


def test_too_tall_cell_scrolls_and_pagedown_scrolls_it_first(first_deck):
    page = first_deck.page
    pieces = page.evaluate(ADD_SLIDE, [100, 2000])  # one cell taller than any slide
    assert [(p["cells"], p["scrolls"]) for p in pieces] == [(1, False), (1, True)], pieces
    tall = pieces[1]
    page.evaluate("([h, v]) => Reveal.slide(h, v)", [tall["h"], tall["v"]])
    seen = []
    for _ in range(8):  # a remote's PageDown: scroll to the end of the slide, then the next slide
        page.keyboard.press("PageDown")
        seen.append(page.evaluate("() => [Reveal.getIndices().h, Reveal.getIndices().v,"
                                  " Reveal.getCurrentSlide().scrollTop]"))
        if seen[-1][:2] != [tall["h"], tall["v"]]:
            break
    assert seen[0][:2] == [tall["h"], tall["v"]] and seen[0][2] > 0, f"PageDown left the scrolling slide: {seen}"
    assert seen[-1][:2] != [tall["h"], tall["v"]], f"PageDown never moved on from the scrolling slide: {seen}"
    assert seen[-2][2] > seen[0][2], f"PageDown did not scroll to the end first: {seen}"


def test_speaker_notes(deck, build):
    stem, d = deck
    notes = d.page.evaluate("() => Array.from(document.querySelectorAll('aside.notes')).map(a => a.innerText.trim())")
    first = d.page.evaluate("() => (Reveal.getSlideNotes(Reveal.getSlides()[0]) || '').trim()")
    assert first, f"{stem}: the first slide has no speaker notes"
    notes_file = NOTES / f"{stem}.md"
    if stem in NOTES_REQUIRED:
        assert notes_file.is_file(), f"{stem}: no speaker notes written ({notes_file.relative_to(ROOT)})"
    if notes_file.is_file():
        # Every section of the notes file reached the deck: a renamed heading must not drop its notes silently.
        lost = [line for line in build.splitlines() if notes_file.name in line]
        assert not lost, f"{stem}: rename the notes section to the notebook's new heading:\n" + "\n".join(lost)
        assert len([n for n in notes if n]) >= 2, f"{stem}: speaker notes on fewer than 2 slides"


def test_speaker_view_opens_offline(browser):
    """Pressing `s` opens reveal.js's speaker view (a second window with the notes, current and next slide)."""
    d = Deck(browser, NOTEBOOKS[0].stem)
    try:
        with d.context.expect_page(timeout=30_000) as popup:
            d.page.keyboard.press("s")
        view = popup.value
        view.wait_for_function("() => { const n = document.querySelector('.speaker-controls-notes');"
                               " return n && n.innerText.trim().length > 40; }", timeout=30_000)
        assert not d.external, f"the speaker view loaded from the internet: {sorted(set(d.external))}"
    finally:
        d.close()
