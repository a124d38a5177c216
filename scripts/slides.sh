#!/usr/bin/env bash
# `make slides`: one reveal.js deck per notebook in slides/, usable offline (a workshop room's Wi-Fi is no
# dependency). reveal.js, require.js, jQuery and MathJax come from the npm registry into slides/vendor/ once; the decks
# point at them by relative path instead of nbconvert's CDN defaults. Cells' slideshow metadata picks the slides;
# slides/README.md tells instructors the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
vendor=slides/vendor/node_modules
if [[ ! -f $vendor/reveal.js/dist/reveal.js || ! -f $vendor/requirejs/require.js || ! -f $vendor/mathjax/MathJax.js \
      || ! -f $vendor/jquery/dist/jquery.min.js ]]; then
  command -v npm >/dev/null || { echo "slides: error: npm not found; install Node.js (apt-get install nodejs npm)" >&2; exit 1; }
  npm install --loglevel=error --prefix slides/vendor --no-save --no-audit --no-fund \
    reveal.js@4.6.0 requirejs@2.3.8 mathjax@2.7.9 jquery@2.2.4
fi
# One Python process for all decks: speaker notes from slides/notes/, slides fitted to the screen, nothing from a CDN
# (scripts/slides_export.py says how). The notebooks themselves are not touched.
"$VENV/bin/python" scripts/slides_export.py --out slides --notes slides/notes notebooks/[0-9][0-9]*_*.ipynb notebooks/appendix_*.ipynb
# Nothing may be loaded from the internet (links in the text are fine): a deck must open from the file system.
if grep -lE '(<script[^>]* src|<link[^>]* href)="https?://|import [^;]* from .https?://' slides/*.slides.html; then
  echo "slides: error: the decks above still load something from the internet" >&2
  exit 1
fi
