"""The shape of the project: consecutive trainers differ by small, tagged diffs; files that must agree do."""
from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

SRC = ROOT / "src" / "tutorial"
# Each data-parallel stage is a diff of its parent (the one its notebook diffs it against), tagged with its name.
STAGES = {"train_dp": "# DP", "train_ddp": "# DDP", "train_horovod": "# Horovod", "train_fsdp": "# FSDP",
          "train_deepspeed": "# DeepSpeed"}
PARENTS = {"train_dp": "train_single", "train_ddp": "train_single", "train_horovod": "train_single",
           "train_fsdp": "train_ddp", "train_deepspeed": "train_ddp"}
# train_lightning.py hands the loop to Lightning's Trainer, so it cannot be a line diff of train_single.py; it keeps
# setup/build/main(cfg) and the same core, and is held to the same size.
OTHER_TRAINERS = ["train_lightning"]


def is_tag(comment: str, tag: str) -> bool:
    """A comment token that starts with the tag (`# DDP`, `# DDP: why`); `# DDPX` is not `# DDP`."""
    return bool(tag) and comment.startswith(tag) and comment[len(tag):len(tag) + 1] in ("", ":", " ")


def source_lines(text: str):
    """Per line of `text`: its code without the comment, its comment token ("" if none), and the (first, last) line
    of the statement (logical line) it belongs to, None for a blank or comment-only line; and the docstrings' lines.
    From tokenize and ast, so a `#` in a string is text, not a comment."""
    import ast
    import io
    import tokenize
    lines = text.splitlines()
    code, comment, stmt = [line.rstrip() for line in lines], [""] * len(lines), [None] * len(lines)
    first = None
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        row = tok.start[0] - 1
        if tok.type == tokenize.COMMENT:
            comment[row], code[row] = tok.string, lines[row][:tok.start[1]].rstrip()
        elif tok.type == tokenize.NEWLINE:
            for r in range(first, row + 1):
                stmt[r] = (first, row)
            first = None
        elif tok.type not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER):
            first = row if first is None else first
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno - 1, body[0].end_lineno))
    return code, comment, stmt, docstrings


def covered_lines(text: str, tag: str, changed: set[int], moved: set[str]) -> set[int]:
    """The lines of `text` that a `tag` explains (the rule is untagged_additions' docstring)."""
    lines = text.splitlines()
    code, comment, stmt, docstrings = source_lines(text)
    covered, blocks, bodies = set(docstrings), [], []  # the indents of open tagged comments' blocks, covered headers
    for r, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            blocks.clear()
        elif stmt[r] is None:  # a comment on a line of its own: it ends the blocks at its indentation and deeper
            continues = r - 1 in covered and stmt[r - 1] is None and lines[r - 1].startswith(" " * indent + "#")
            blocks[:] = [b for b in blocks if b < indent]
            if is_tag(comment[r], tag) or continues:
                covered.add(r)
                blocks.append(indent)
        elif stmt[r][0] == r:  # a statement starts here
            first, last = stmt[r]
            clause = re.fullmatch(r"\s*(else|finally)\s*:", code[r]) is not None
            while bodies and (indent < bodies[-1] or indent == bodies[-1] and not clause):
                bodies.pop()
            blocks[:] = [b for b in blocks if b <= indent]
            in_block = bool(blocks) and blocks[-1] == indent and any(j in changed for j in range(first, last + 1))
            if blocks and blocks[-1] == indent and not in_block:
                blocks.pop()  # an unchanged statement ends the block
            tagged = any(is_tag(comment[j], tag) for j in range(first, last + 1))
            was_moved = all(code[j].strip() in moved for j in range(first, last + 1) if code[j].strip())
            if tagged or in_block or (bodies and (was_moved or clause)) or r in docstrings:
                covered.update(range(first, last + 1))
                if code[last].endswith(":") and not clause:
                    bodies.append(indent)  # its body: the lines indented deeper than it
    return covered


def untagged_additions(old_text: str, new_text: str, tag: str, parent_tag: str | None = None) -> list[str]:
    """Lines a stage changes over its parent that no tag explains: added lines without one, and parent lines it
    removes without putting anything in their place, when parent_tag is given (a stage may drop lines its parent
    tagged with parent_tag, and move a line elsewhere). Blank lines and docstrings need no tag. The rule:

    - A tag is a comment token that starts with it (`# DDP`, `# DDP: why`), found by tokenize: a tag inside a
      string is text, not a tag.
    - A statement is covered when one of its lines carries the tag (a call over three lines needs it once).
    - A tagged comment on a line of its own (and the comment lines under it at its indentation, which continue it)
      covers the block under it, as accelerate's `# New Code #` does: the changed statements that start at the
      comment's indentation, up to the first blank line, comment, unchanged statement or statement at a smaller
      indentation. It does not cover the bodies of the `if`/`for`/`with` statements in that block.
    - A covered statement that opens a block (`if ...:`, `try:`) covers, in its body, only what the diff moved
      there from the parent (the same code that it removes elsewhere, e.g. re-indented under a new `if`), and its
      own `else:`/`finally:`; new code in the body needs its own tag.
    What a tagged comment still vouches for: a new statement put directly under it at its own indentation, in its
    block. That is what a block comment is for; keep such blocks short."""
    import difflib
    old, new = old_text.splitlines(), new_text.splitlines()
    old_code = source_lines(old_text)[0]
    opcodes = difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
    moved = {old_code[i].strip() for op, i1, i2, _, _ in opcodes if op in ("replace", "delete") for i in range(i1, i2)}
    changed = {j for op, _, _, j1, j2 in opcodes if op in ("replace", "insert") for j in range(j1, j2)}
    covered = covered_lines(new_text, tag, changed, moved - {""})
    new_code = source_lines(new_text)[0]
    kept = {line.strip() for line in new_code}
    bad = [f"line {j + 1}: {new[j].strip()}" for j in sorted(changed) if new[j].strip() and j not in covered]
    if parent_tag is not None:
        by_parent = covered_lines(old_text, parent_tag, set(range(len(old))), set())
        bad += [f"removed line {i + 1}: {old[i].strip()}" for op, i1, i2, _, _ in opcodes if op == "delete"
                for i in range(i1, i2) if old[i].strip() and i not in by_parent and old_code[i].strip() not in kept]
    return bad


def read(name: str) -> str:
    return (SRC / f"{name}.py").read_text()


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_added_line_is_tagged(stage):
    assert untagged_additions(read(PARENTS[stage]), read(stage), STAGES[stage], STAGES.get(PARENTS[stage], "")) == []


# The model-parallel stages: each is a diff of the one before it (base, tag): train_gpt is one process.
MODEL_PARALLEL_STAGES = {"train_tp": ("train_gpt", "# TP"), "train_pp": ("train_gpt", "# PP"),
                         "train_2d": ("train_tp", "# 2D")}
MODEL_PARALLEL_PARENT_TAGS = {"train_2d": "# TP"}  # what train_2d may drop of train_tp: its TP lines, imported


@pytest.mark.parametrize("stage", list(MODEL_PARALLEL_STAGES))
def test_every_model_parallel_line_is_tagged(stage):
    base, tag = MODEL_PARALLEL_STAGES[stage]
    assert untagged_additions(read(base), read(stage), tag, MODEL_PARALLEL_PARENT_TAGS.get(stage, "")) == []


def changed_lines(parent: str, stage: str) -> int:
    """The + and - lines of `diff -u parent.py stage.py`."""
    diff = difflib.unified_diff(read(parent).splitlines(), read(stage).splitlines(), lineterm="")
    return sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))


def test_the_ddp_lesson_is_a_short_diff():
    """diff -u train_single.py train_ddp.py is the DDP lesson and little else: at most 40 changed lines, every one
    tagged (above). The DDP tutorial series makes the same change in about 20; infrastructure goes to core."""
    assert changed_lines("train_single", "train_ddp") <= 40


def test_the_tag_check_catches_an_untagged_line():
    sneaky = read("train_ddp").replace("    model.train()\n", "    model.train()\n    model.requires_grad_(True)\n")
    assert [line.split(": ", 1)[1] for line in untagged_additions(read("train_single"), sneaky, "# DDP")] == \
        ["model.requires_grad_(True)"]


def test_a_tagged_block_covers_its_body_only():
    """A tagged `if`/`try` covers the lines indented under it, and nothing after the block ends."""
    ddp = read("train_ddp")
    save = "            checkpoint.save(cfg, model, loop.optimizer, loop.precision.scaler, state)\n"
    assert "        if dist.get_rank() == 0:  # DDP" in ddp and save in ddp  # the if's body, covered by its tag
    sneaky = ddp.replace(save, save + "        print(state)\n")
    assert [line.split(": ", 1)[1] for line in untagged_additions(read("train_single"), sneaky, "# DDP")] == \
        ["print(state)"]


def test_the_tag_check_catches_a_removed_line():
    quiet = read("train_ddp").replace("        if checkpoint.trained_before(state, i):", "        if False:")
    quiet = quiet.replace("    model.train()\n", "")
    found = untagged_additions(read("train_single"), quiet, "# DDP", "")
    assert [line.split(": ", 1)[1].split("  #")[0] for line in found] == ["model.train()", "if False:"], found


def test_the_model_parallel_tag_check_catches_an_untagged_line():
    sneaky = read("train_2d").replace("    optimizer.step()\n", "    optimizer.step()\n    model.zero_grad()\n")
    assert [line.split(": ", 1)[1] for line in untagged_additions(read("train_tp"), sneaky, "# 2D")] == \
        ["model.zero_grad()"]


@pytest.mark.parametrize("stage", ["train_single", *STAGES, *OTHER_TRAINERS, "train_gpt",
                                   *MODEL_PARALLEL_STAGES])
def test_trainers_stay_small(stage):
    lines = read(stage).splitlines()
    assert len(lines) <= 180, f"{stage}.py has {len(lines)} lines; a stage should read top to bottom"


@pytest.mark.parametrize("stage", ["train_single", *STAGES])
def test_trainers_share_the_skeleton(stage):
    text = read(stage)
    for name in ("def setup(", "def build(", "def train_one_epoch(loop: Loop", "def evaluate(loop: Loop",
                 "def fit(loop: Loop", "def main(cfg: TrainConfig, build=build)", 'if __name__ == "__main__":',
                 "for X, y in", "for epoch in range("):
        assert name in text, f"{stage}.py lacks {name!r}"


@pytest.mark.parametrize("stage", OTHER_TRAINERS)
def test_other_trainers_keep_setup_build_main(stage):
    text = read(stage)
    for name in ("def setup(cfg: TrainConfig)", "def build(", "def main(cfg: TrainConfig) -> dict",
                 'if __name__ == "__main__":', "from .core"):
        assert name in text, f"{stage}.py lacks {name!r}"


def requirement_pins() -> dict:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def test_requirements_are_pinned_and_pair_torch_with_torchvision():
    pins = requirement_pins()
    assert "+cpu" not in pins["torch"], "a +cpu torch breaks PyPI's torchvision"
    major, minor = map(int, pins["torch"].split(".")[:2])
    tv_minor = int(pins["torchvision"].split(".")[1])
    assert tv_minor == minor + 15 and major == 2, "torchvision 0.N pairs with torch 2.(N-15)"


def test_environment_yml_uses_requirements_txt():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    pip = next(d["pip"] for d in deps if isinstance(d, dict))
    assert "-r requirements.txt" in pip and "-e ." in pip
    conda = [d for d in deps if isinstance(d, str)]
    python = next(d for d in conda if d.startswith("python"))
    assert re.search(r"3\.1[0-2]", python)
    for needed in ("openmpi", "mpi4py", "cmake", "cxx-compiler"):
        assert any(d.startswith(needed) for d in conda), needed
    # mpi4py comes from conda (built against conda's MPI); it must be the same version as the pip pin.
    mpi4py = next(d for d in conda if d.startswith("mpi4py"))
    assert mpi4py.split("=")[-1] == requirement_pins()["mpi4py"]


def test_deepspeed_is_pinned_once_and_installed_against_torch():
    """requirements.txt pins DeepSpeed (environment.yml reuses it); install.sh takes the version from there and builds
    it with --no-build-isolation and DS_BUILD_OPS=0, and leaves it out of the plain `pip install -r`."""
    pins = requirement_pins()
    assert pins["deepspeed"] and pins["lightning"]
    for need in ("hjson", "py-cpuinfo", "pydantic", "msgpack", "einops", "nvidia-ml-py", "ninja", "psutil"):
        assert need in pins, f"DeepSpeed needs {need}: pin it in requirements.txt"
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert "grep -v '^deepspeed=='" in install and "--no-build-isolation" in install and "DS_BUILD_OPS=0" in install
    assert pins["deepspeed"] not in install, "install.sh must read the version from requirements.txt"
    assert f"deepspeed=={pins['deepspeed']}" in (ROOT / "environment.yml").read_text()


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme
    commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.strip().startswith("#")]
    assert "make test" in commands  # a command of its own, not a word in a comment or an echo


# ------------------------------------------------------------------------------------- imports run one way
# Which rooms of the package each room may import (function-level imports count too). The trainers and the core are
# what learners read and copy, so they must never depend on notebook helpers, launchers or benchmarks.
ALLOWED = {
    "core": {"core"},
    "train": {"core", "train"},  # train_2d builds on train_tp's plan (a diff of it); a circle still fails
    "launch": {"core", "train", "launch"},
    "bench": {"core", "train", "launch", "bench"},
    "cli": {"core", "train", "launch", "bench", "cli"},
    "lessons": {"core", "train", "launch", "bench", "lessons"},
}


def room(module: str) -> str:
    part = module.split(".")[1] if "." in module else ""
    if part == "__init__":
        return "core"  # the package's own __init__ holds the version only; Python runs it before any submodule
    return "train" if part.startswith("train_") else part if part in ALLOWED else "cli"


def import_graph(files: dict[str, str]) -> dict[str, set[str]]:
    """module -> the package modules it imports, from source (module name -> text), relative imports resolved."""
    import ast
    graph = {m: set() for m in files}
    for module, text in files.items():
        package = module if module.endswith("__init__") else module.rsplit(".", 1)[0]
        package = package.removesuffix(".__init__")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                for candidate in (name, f"{name}.__init__"):
                    if candidate in graph and candidate != module:
                        graph[module].add(candidate)
    return graph


def package_sources() -> dict[str, str]:
    return {"tutorial." + str(p.relative_to(SRC).with_suffix("")).replace("/", "."): p.read_text()
            for p in SRC.rglob("*.py")}


def layer_violations(graph) -> list[str]:
    return [f"{m} imports {t}" for m, targets in graph.items() for t in sorted(targets)
            if room(t) not in ALLOWED[room(m)]]


def cycles(graph) -> list[list[str]]:
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_imports_run_one_way_without_circles():
    graph = import_graph(package_sources())
    assert len(graph) > 20 and any(graph.values()), "the import graph was not read"
    assert layer_violations(graph) == []
    assert cycles(graph) == []


def test_root_only_machinery_stays_out_of_the_package():
    """The virtual cluster (network namespaces, Slurm's daemons, apt-get) is a tool of the repository, tools/vcluster/:
    nothing the package installs runs these commands, so no notebook cell can."""
    import ast
    commands = {"apt-get", "apt", "ip", "nsenter", "unshare", "slurmctld", "slurmd", "munged"}
    found = [f"{path.relative_to(SRC)}:{node.lineno} {node.value!r}" for path in SRC.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and node.value in commands]
    assert found == []
    assert (ROOT / "tools" / "vcluster" / "__main__.py").exists()


def test_the_import_check_catches_a_back_edge_and_a_circle():
    files = package_sources()
    files["tutorial.core.config"] += "\nfrom ..lessons import notebook\n"
    files["tutorial.core.config"] += "\ndef f():\n    from .process import free_port\n"  # process imports config
    graph = import_graph(files)
    assert "tutorial.core.config imports tutorial.lessons.notebook" in layer_violations(graph)
    assert any("tutorial.core.config" in c and "tutorial.core.process" in c for c in cycles(graph))


def test_the_simulated_gpu_lane_runs_every_notebook_and_its_promises_point_at_their_cells():
    """make test's simulated-GPU lane runs every numbered notebook as a one-GPU attendee's but the three the Makefile
    names with its reasons (04 and 09 on the CPU, 06 in strict nbval only); a promise the lane checks
    from a cell on (tests/simgpu/lane.py PROMISES) names the cell that makes it, so a moved cell cannot leave it
    checking from the wrong place."""
    import json
    import sys
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^ONE_GPU_NOTEBOOKS \?= \$\(filter-out \$\(CPU_LANE_NOTEBOOKS\) \$\(NO_LANE_NOTEBOOKS\),"
                     r"\$\(wildcard notebooks/\[0-9\]\[0-9\]\*_\*\.ipynb\)\)$", makefile, re.M)
    assert re.search(r"^NO_LANE_NOTEBOOKS = notebooks/06_multi_node.ipynb$", makefile, re.M)
    # 06 stays out only while its cells read the preset just to print it or to ask `allocation` for ranks of their
    # own (trainer=None, whose cfg they do not use): another use of `cfg`, a preset made from another name, or a
    # launch given the chosen preset puts it back in the lane (the check the workshop-cpu lane had for its left-outs)
    allowed = (re.compile(r"^cfg = notebook\.choose_preset\(\)$"),
               re.compile(r"^alloc = notebook\.allocation\(\d+, cfg, trainer=None\)"))
    code = "\n".join("".join(c["source"]) for c in json.loads((ROOT / "notebooks" / "06_multi_node.ipynb").read_text())[
        "cells"] if c["cell_type"] == "code")
    uses = [line.strip() for line in code.splitlines() if re.search(r"\bcfg\b", line)]
    assert all(any(p.match(u) for p in allowed) for u in uses), uses
    assert "alloc.cfg" not in code and "preset_name" not in code
    assert set(re.findall(r'preset\("([\w-]+)"', code)) <= {"smoke"} and "--preset {" not in code
    left = re.search(r"^CPU_LANE_NOTEBOOKS = (.*)$", makefile, re.M).group(1).split()  # the two left, with reasons
    assert left == ["notebooks/04_mixed_precision.ipynb", "notebooks/09_sharded_training.ipynb"], left
    assert "$(SIMGPU_LANE)" in makefile.split("test-notebooks:")[1].split("\n\n")[0]
    sys.path.insert(0, str(ROOT / "tests" / "simgpu"))
    try:
        from lane import PROMISES
    finally:
        sys.path.remove(str(ROOT / "tests" / "simgpu"))
    for notebook, promises in PROMISES.items():
        cells = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
        for start, _, _, _, marker in promises:
            assert marker in "".join(cells[start]["source"]), (notebook, start, marker)
