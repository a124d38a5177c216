"""Export the notebooks as reveal.js decks that fit the screen, carry speaker notes and load nothing from the internet.

Run by scripts/slides.sh (`make slides`); slides/README.md is the instructor's guide. The notebooks are read, never
written: everything below happens to an in-memory copy at export time.

- Speaker notes come from slides/notes/<notebook>.md: each `## Heading` section there becomes a reveal.js notes cell
  right after the notebook heading that starts with the same words (press `s` in a deck). A section whose heading no
  longer exists is reported, not silently dropped. A notebook without a notes file gets a generated note on its
  first slide that says so.
- A notebook without any slideshow metadata gets slides from its headings (`#`/`##` start a slide, `###` a
  vertical sub-slide), so a new notebook is not one endless slide.
- Fitting is measured, not guessed: a small script in each deck (FIT_JS below) runs once reveal.js is ready and
  splits any slide taller than the 1280x720 canvas at cell boundaries into vertical sub-slides (a code cell whose
  input and output do not fit together is split between them). A single cell up to 25 % too tall is shrunk (to no
  less than 80 %); only one taller still is left as a scrolling slide (a scroll bar; PageDown/Down scroll it before
  moving on). Because reveal.js lays out on a fixed canvas and scales it to the screen, the result is the same on a
  laptop and on a projector.
- Offline: reveal.js, require.js, jQuery and MathJax by relative path into slides/vendor/ (installed there from the
  npm registry by scripts/slides.sh); reveal's "white" theme, whose fonts ship with it (nbconvert's default "simple"
  imports Google fonts); nbconvert's mermaid.js import from a CDN is left out (no notebook uses mermaid) and
  ipywidgets' state is dropped (its renderer would also come from a CDN).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat
from jinja2 import DictLoader
from nbconvert import SlidesExporter

from cell_times import cell_seconds  # scripts/, this script's folder

# A cell the notes may call slow: the notes name a section's slowest cell from here on (and
# tests/test_prose_claims.py holds "the slow cell" of the notes to it).
SLOW_S = 5.0

# The canvas reveal.js lays slides out on before scaling them to the screen: 16:9, like projectors and laptops.
WIDTH, HEIGHT = 1280, 720

CSS = """
<style type="text/css">
/* scripts/slides_export.py: slides that fit. Long lines wrap instead of scrolling sideways. */
.reveal .jp-InputArea-editor pre, .reveal .jp-OutputArea-output pre {
  white-space: pre-wrap; word-break: normal; overflow-wrap: anywhere; }
.reveal div.highlight > pre { box-sizing: border-box; }  /* width 100% plus padding stuck out of the cell */
.reveal .jp-RenderedHTMLCommon table { max-width: 100%; }
/* The white theme capitalises headings; code names in headings (`DistributedSampler`, `%%px`) must stay as typed. */
.reveal .slides section :is(h1, h2, h3, h4, h5, h6) { text-transform: none; }
/* A plot leaves room for the code that made it. */
.reveal .jp-OutputArea-output img { max-width: 100%; max-height: 520px; width: auto; height: auto; }
.reveal .slides > section > section.fit-scroll { height: 100%; overflow-y: scroll; box-sizing: border-box; }
/* A cue that stays at the bottom edge of a scrolling slide until its end is reached. */
.reveal .slides > section > section.fit-scroll::after {
  content: "\\25BC  scroll (PageDown)"; display: block; position: sticky; bottom: 0; text-align: center;
  padding: 28px 0 2px 0; font-size: 16px; color: #888; pointer-events: none;
  background: linear-gradient(rgba(255, 255, 255, 0), #fff 70%); }
.reveal .fit-continued { font-size: 18px; color: #888; margin: 0 0 6px 0; text-align: left; }
</style>
"""

# Runs in the deck (tests/test_slides.py calls fitSlides too). Idempotent: slides already split or marked stay so.
FIT_JS = r"""
function fitSlides(Reveal) {
  var H = Reveal.getConfig().height, label = 40;
  var changed = false;
  function units(section) {
    return Array.prototype.filter.call(section.children, function (el) {
      return !el.matches('aside.notes') && !el.classList.contains('fit-continued');
    });
  }
  // The last heading at or before this slide in its vertical stack names the slides split from it.
  function title(section) {
    for (var s = section; s; s = s.previousElementSibling) {
      var hs = s.querySelectorAll('h1, h2, h3');
      if (hs.length) return hs[hs.length - 1].textContent.replace(/\u00b6/g, '').trim();
    }
    return '';
  }
  function piece(after, heading) {
    var next = document.createElement('section');
    next.className = 'fit-piece';
    next.style.display = 'block';
    var note = document.createElement('div');
    note.className = 'fit-continued';
    note.textContent = heading || 'continued';
    next.appendChild(note);
    after.parentNode.insertBefore(next, after.nextSibling);
    return next;
  }
  Array.prototype.forEach.call(document.querySelectorAll('.reveal .slides > section > section'), function (section) {
    if (section.classList.contains('fit-scroll') || section.classList.contains('fit-piece')) return;
    // reveal.js hides slides far from the current one; measuring needs them (and their stack) laid out.
    var stack = section.parentNode, shown = [stack.style.display, section.style.display];
    stack.style.display = 'block';
    section.style.display = 'block';
    if (section.scrollHeight > H) {
      changed = true;
      var heading = title(section);
      // A code cell too tall for a slide: its output goes on a sub-slide of its own.
      units(section).forEach(function (u) {
        var input = u.querySelector(':scope > .jp-Cell-inputWrapper');
        var output = u.querySelector(':scope > .jp-Cell-outputWrapper');
        if (!u.matches('.jp-CodeCell') || !input || !output || u.offsetHeight + label <= H) return;
        var rest = u.cloneNode(false);
        rest.removeAttribute('id');
        rest.classList.add('fit-output');
        u.parentNode.insertBefore(rest, u.nextSibling);
        rest.appendChild(output);
      });
      // Greedy, measured: units go on the current slide until one does not fit, then on a new one.
      var us = units(section), current = section, count = 0, pieces = [section];
      us.forEach(function (u) { u.parentNode.removeChild(u); });
      us.forEach(function (u) {
        current.appendChild(u);
        count += 1;
        if (current.scrollHeight > H && count > 1) {
          current.removeChild(u);
          current = piece(current, heading);
          pieces.push(current);
          current.appendChild(u);
          count = 1;
        }
      });
      pieces.forEach(function (p, i) {
        // A sub-slide of its own already is the step a fragment was for: show it at once.
        var first = units(p)[0];
        if (p !== section && first && first.classList.contains('fragment')) first.classList.remove('fragment');
        if (pieces.length > 1) {
          var note = p.querySelector(':scope > .fit-continued');
          if (note) note.textContent += ' (' + (i + 1) + '/' + pieces.length + ')';
        }
        // One cell taller than a slide: a little too tall shrinks (to 80% at most), more than that scrolls.
        if (p.scrollHeight > H && p.scrollHeight <= H * 1.25) {
          // (on the cells: zoom on a fragment's wrapper has no effect in Chromium)
          var cells = [];
          units(p).forEach(function (u) {
            cells = cells.concat(u.matches('.fragment') ? Array.from(u.children) : [u]);
          });
          var zoom = function (z) { cells.forEach(function (c) { c.style.zoom = z; }); };
          var z = H / p.scrollHeight;
          zoom(z);
          for (var k = 0; k < 5 && p.scrollHeight > H && z * 0.98 >= 0.8; k++) zoom(z *= 0.98);  // margins stay
          if (p.scrollHeight > H) zoom('');
        }
        if (p.scrollHeight > H) p.classList.add('fit-scroll');
        if (p !== section) p.style.display = shown[1];
      });
    }
    section.style.display = shown[1];
    stack.style.display = shown[0];
  });
  if (changed) { Reveal.sync(); Reveal.layout(); }
  document.documentElement.setAttribute('data-slides-fitted', 'true');
}

// PageDown/PageUp (presentation remotes) and Down/Up scroll a scrolling slide before they move on.
function scrollOr(Reveal, direction, move) {
  return function () {
    var s = Reveal.getCurrentSlide();
    if (s && s.classList.contains('fit-scroll')) {
      var step = s.clientHeight * 0.8, max = s.scrollHeight - s.clientHeight;
      if (direction > 0 && s.scrollTop < max - 1) { s.scrollTop = Math.min(max, s.scrollTop + step); return; }
      if (direction < 0 && s.scrollTop > 0) { s.scrollTop = Math.max(0, s.scrollTop - step); return; }
    }
    Reveal[move]();
  };
}
"""

TEMPLATE = r"""{%- extends 'index.html.j2' -%}
{# scripts/slides_export.py: nbconvert's reveal template without its CDN mermaid.js import, with the fitting script #}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{% block notebook_css %}
{{ super() }}
""" + CSS + r"""
{% endblock notebook_css %}
{% block footer_js %}
<script>
""" + FIT_JS + r"""
require(
    {waitSeconds: 60},
    ["{{ resources.reveal.url_prefix }}/dist/reveal.js", "{{ resources.reveal.url_prefix }}/plugin/notes/notes.js"],
    function (Reveal, RevealNotes) {
        window.Reveal = Reveal;  // for the speaker view and the browser test
        Reveal.initialize({
            controls: true,
            progress: true,
            history: true,
            slideNumber: "c/t",
            transition: "{{ resources.reveal.transition }}",
            plugins: [RevealNotes],
            width: {{ resources.reveal.width }},
            height: {{ resources.reveal.height }},
            margin: 0.04,
            keyboard: {
                34: scrollOr(Reveal, 1, 'next'), 33: scrollOr(Reveal, -1, 'prev'),
                40: scrollOr(Reveal, 1, 'down'), 38: scrollOr(Reveal, -1, 'up')
            }
        });
        Reveal.on('slidechanged', function () {
            if (window.MathJax && MathJax.Hub && MathJax.Hub.getAllJax(Reveal.getCurrentSlide())) {
                MathJax.Hub.Rerender(Reveal.getCurrentSlide());
            }
        });
        // Fit once reveal.js is laid out and MathJax has typeset (formulas change heights); images are inline.
        Reveal.on('ready', function () {
            var fit = function () { fitSlides(Reveal); };
            if (window.MathJax && MathJax.Hub) MathJax.Hub.Queue(fit); else fit();
        });
    }
);
</script>
{% endblock footer_js %}
"""

NOTES_HELP = "slides/notes/<notebook>.md: `## Heading` sections, each matched to the notebook heading it starts"


def normalize(text: str) -> str:
    """Heading text without markup, for matching a notes section to a heading: '`%%px`' -> '%%px'."""
    text = re.sub(r"[`*_]", "", text.lstrip("#")).replace("\u00b7", " ")
    return " ".join(text.lower().split())


def headings(cell) -> list[str]:
    """Markdown headings of a cell (lines starting with #), outside fenced code blocks."""
    if cell.cell_type != "markdown":
        return []
    found, fenced = [], False
    for line in cell.source.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append(line)
    return found


def parse_notes(text: str) -> list[tuple[str, str]]:
    """`## Heading` sections of a notes file, in order, as (heading, markdown). Text before the first is ignored."""
    sections, current = [], None
    for line in text.splitlines():
        if line.startswith("## "):
            current = [line[3:].strip(), []]
            sections.append(current)
        elif current is not None:
            current[1].append(line)
    return [(heading, "\n".join(body).strip()) for heading, body in sections]


def has_slideshow(nb) -> bool:
    return any(cell.metadata.get("slideshow", {}).get("slide_type") for cell in nb.cells)


def slides_from_headings(nb) -> None:
    """A notebook without slideshow metadata: `#`/`##` headings start slides, `###` headings sub-slides."""
    for cell in nb.cells:
        first = headings(cell)[:1]
        if first and cell.source.lstrip().startswith(first[0]):
            level = len(first[0]) - len(first[0].lstrip("#"))
            cell.metadata["slideshow"] = {"slide_type": "slide" if level <= 2 else "subslide"}


def recorded_time(cells, what="these cells") -> str:
    """One line for the notes: the recorded run time of these cells, and the slowest one if it is slow."""
    timed = [(t, cell) for cell in cells if cell.cell_type == "code" for t in [cell_seconds(cell)] if t is not None]
    if not timed:
        return ""
    total = sum(t for t, _ in timed)
    slow, cell = max(timed, key=lambda x: x[0])
    line = f"*Recorded run time of {what}: {total:.0f} s"
    if slow >= SLOW_S:
        code = "; ".join([l.strip() for l in cell.source.splitlines()
                          if l.strip() and not l.lstrip().startswith(("#", "%%"))][:2])
        line += f"; slowest {slow:.0f} s: `{code if len(code) <= 90 else code[:89] + chr(0x2026)}`"
    return line + " (CPU preset, where the stored outputs were made; a GPU node or a busy laptop differs).*"


def _heads(cells) -> list[tuple[int, int, str]]:
    """(cell index, level, normalized text) of each cell's first heading: the headings that start slides."""
    return [(i, len(h) - len(h.lstrip("#")), normalize(h)) for i, cell in enumerate(cells) for h in headings(cell)[:1]]


def _section_end(heads, index: int, level: int, default: int) -> int:
    """Where the section of the heading at cell `index` ends: the next slide heading of the same or a higher level."""
    return next((j for j, lv, _ in heads if j > index and lv <= level), default)


def notes_sections(cells, notes_text: str) -> tuple[list[tuple[str, str, range]], list[str]]:
    """(heading, body, the cells it covers) of each notes section, matched to the notebook heading it starts, and
    the headings that matched none. A section covers its heading's cell up to the next heading of the same or a
    higher level: the cells its slides show (tests/test_prose_claims.py reads their recorded run times)."""
    heads = _heads(cells)
    hidden = [(i, len(h) - len(h.lstrip("#")), normalize(h))
              for i, cell in enumerate(cells) for h in headings(cell)[1:]]
    found, missing = [], []
    for heading, body in parse_notes(notes_text):
        key = normalize(heading)
        match = next(((i, lv) for i, lv, h in heads if h.startswith(key)), None) or next(
            ((i, lv) for i, lv, h in hidden if h.startswith(key)), None)
        if match is None:
            missing.append(heading)
        else:
            found.append((heading, body, range(match[0], _section_end(heads, match[0], match[1], len(cells)))))
    return found, missing


def add_notes(nb, notes_file: Path, notebook: Path) -> list[str]:
    """Notes cells after headings: the notes file's sections, and each section's recorded run time.

    Returns a warning per notes section that matched no heading."""
    cells = nb.cells
    heads = _heads(cells)
    notes: dict[int, list[str]] = {}
    warnings = []
    if notes_file.is_file():
        sections, missing = notes_sections(cells, notes_file.read_text())
        for _, body, covered in sections:
            notes.setdefault(covered.start, []).append(body)
        warnings = [f"{notes_file.as_posix()}: '## {heading}' matches no heading in {notebook.as_posix()}; "
                    "its notes are not in the deck" for heading in missing]
    else:
        titles = [h.lstrip("# ") for cell in cells for h in headings(cell) if h.startswith("## ")]
        time = next((m.group(0) for cell in cells if cell.cell_type == "markdown"
                     for m in [re.search(r"\*\*Time:?\*\*[^\n]*", cell.source)] if m), "")
        notes.setdefault(heads[0][0] if heads else first_visible(nb), []).append(
            f"No speaker notes written for this notebook yet ({notes_file.as_posix()}). {time}\n\n"
            "Sections: " + "; ".join(titles))
    # The recorded run time of each section: up to the next heading of the same or a higher level.
    for i, level, _ in heads:
        if level > 2 and i not in notes:
            continue
        end = _section_end(heads, i, level, len(cells))
        line = recorded_time(cells[i:end], "the whole notebook" if level == 1 else "these cells")
        if line:
            notes.setdefault(i, []).append(line)
    # From the end, so earlier indices stay valid.
    for index in sorted(notes, reverse=True):
        cells.insert(index + 1, nbformat.v4.new_markdown_cell(
            "\n\n".join(notes[index]), metadata={"slideshow": {"slide_type": "notes"}}))
    return warnings


def first_visible(nb) -> int:
    return next(i for i, cell in enumerate(nb.cells)
                if cell.metadata.get("slideshow", {}).get("slide_type") not in ("skip", "notes"))


def exporter(vendor: str) -> SlidesExporter:
    exp = SlidesExporter(
        extra_loaders=[DictLoader({"fitting_slides.html.j2": TEMPLATE})],
        template_file="fitting_slides.html.j2",
        reveal_url_prefix=f"{vendor}/reveal.js",
        reveal_width=str(WIDTH), reveal_height=str(HEIGHT),
        reveal_transition="slide", reveal_theme="white",  # "simple" @imports Google fonts
        exclude_input_prompt=True, exclude_output_prompt=True,  # "In [12]:" is noise on a slide; width is not
    )
    exp.require_js_url = f"{vendor}/requirejs/require.js"
    exp.jquery_url = f"{vendor}/jquery/dist/jquery.min.js"
    exp.mathjax_url = f"{vendor}/mathjax/MathJax.js?config=TeX-AMS_HTML-full,Safe"
    return exp


def export(notebook: Path, out_dir: Path, notes_dir: Path, exp: SlidesExporter) -> tuple[Path, list[str]]:
    nb = nbformat.read(notebook, as_version=4)
    nb.metadata.pop("widgets", None)
    if not has_slideshow(nb):
        slides_from_headings(nb)
    warnings = add_notes(nb, notes_dir / f"{notebook.stem}.md", notebook)
    body, _ = exp.from_notebook_node(nb, resources={"metadata": {"name": notebook.stem}})
    deck = out_dir / f"{notebook.stem}.slides.html"
    deck.write_text(body, encoding="utf-8")
    return deck, warnings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("slides"), help="where the decks go (default: slides)")
    parser.add_argument("--notes", type=Path, default=Path("slides/notes"), help=NOTES_HELP)
    parser.add_argument("--vendor", default="vendor/node_modules",
                        help="where reveal.js, requirejs, jquery and mathjax are, relative to --out")
    args = parser.parse_args(argv)
    exp = exporter(args.vendor)
    problems = []
    for notebook in args.notebooks:
        deck, warnings = export(notebook, args.out, args.notes, exp)
        print(deck.as_posix(), flush=True)
        problems += warnings
    for warning in problems:
        print(f"slides: warning: {warning}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
