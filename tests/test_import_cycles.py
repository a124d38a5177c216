"""No import circle anywhere in the repository's Python: the package (src/tutorial) and the repository's tools
(tools/vcluster). A circle makes the import order matter and the modules impossible to read one at a time; the
virtual cluster had one (nodes <-> slurm) until vcluster.cluster took the whole-cluster verbs above both."""
from __future__ import annotations

import pytest
from conftest import ROOT
from test_design import cycles, import_graph

TREES = {"src": ROOT / "src", "tools": ROOT / "tools"}


def sources(top) -> dict[str, str]:
    """Module name -> source, for every .py below `top` (a folder on sys.path: src/, tools/)."""
    files = {}
    for path in sorted(top.rglob("*.py")):
        name = ".".join(path.relative_to(top).with_suffix("").parts)
        files[name] = path.read_text()
    return files


@pytest.mark.parametrize("tree", list(TREES))
def test_no_import_circle(tree):
    files = sources(TREES[tree])
    graph = import_graph(files)
    assert len(graph) > 3 and any(graph.values()), f"the import graph of {tree}/ was not read"
    assert cycles(graph) == []


def test_the_check_sees_a_circle_in_the_tools():
    """Negative control: the circle the tools had (nodes importing slurm inside a function, slurm importing nodes)
    is found."""
    files = sources(TREES["tools"])
    files["vcluster.nodes"] += "\ndef down():\n    from . import slurm\n"
    assert any({"vcluster.nodes", "vcluster.slurm"} <= set(c) for c in cycles(import_graph(files)))
