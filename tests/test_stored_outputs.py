"""Stored notebook outputs hold on any CPU: no compared output prints the last bits of a trained value.

oneDNN, MKL and ATen's vector kernels round differently on AVX2, AVX-512 and AMX machines, and MKL takes a code path
of its own on AMD processors (there it ignores MKL_CBWR's instruction-set branches; only COMPATIBLE changes its
results). A digest of trained weights therefore differs from one CI machine to the next, and a strict nbval
comparison of it fails somewhere. Two guards:

- this scan: every digest (and every decimal the sanitizer leaves) in a compared output must be either rewritten by
  notebooks/sanitize.cfg or listed below as independent of the CPU, with the reason;
- notebooks/conftest.py runs strict nbval under other kernels than the ones `make notebooks` stored the outputs with
  (ROUNDING_PERTURBATION), so an output that depends on rounding fails on the machine that made it.
"""
from __future__ import annotations

import configparser
import json
import re

import pytest
from conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# A digest: 8 or more hex digits with a letter among them, or any 8+ digits right after a word that names one.
DIGEST = re.compile(r"\b(?=[0-9a-f]*[a-f])[0-9a-f]{8,}\b|(?:(?<=weights )|(?<=checksum )|(?<=digest ))\d{8,}\b")
# A decimal the sanitizer let through: three or more digits after the point are finer than what holds across CPUs.
FINE_DECIMAL = re.compile(r"\b\d+\.\d{3,}\b")
# (notebook, text on the printed line, reason): values that come from seeded generators alone, not from training.
INDEPENDENT = [
    ("03a_ddp_by_hand", "before DDP: checksum", "initial weights drawn from a seeded generator (per rank)"),
    ("03a_ddp_by_hand", "after DDP:  checksum", "DDP's constructor broadcasts rank 0's initial weights unchanged"),
    ("05_horovod", "training samples, weights", "initial weights drawn from a seeded generator (per rank)"),
    ("05_horovod", "lr D.DD, weights", "hvd.broadcast_parameters copies rank 0's initial weights unchanged"),
]


def sanitizers() -> list[tuple[re.Pattern, str]]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "notebooks" / "sanitize.cfg")
    return [(re.compile(cfg[section]["regex"]), cfg[section]["replace"]) for section in cfg.sections()]


def compared_outputs(notebook: dict):
    """(cell index, text) of every output strict nbval compares (stream and text/plain, cells not ignored), as it
    compares them: sanitized."""
    rules = sanitizers()
    for index, cell in enumerate(notebook["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or "NBVAL_IGNORE_OUTPUT" in source or "NBVAL_SKIP" in source:
            continue
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain", "")
            text = "".join(text) if isinstance(text, list) else text
            for rule, replacement in rules:
                text = rule.sub(replacement, text)
            yield index, text


def machine_dependent(name: str, notebook: dict) -> list[str]:
    """Lines of compared outputs that, after sanitizing, still print a digest or a fine decimal not listed above."""
    allowed = [text for nb, text, _ in INDEPENDENT if nb == name]
    found = []
    for index, text in compared_outputs(notebook):
        for line in text.splitlines():
            if (DIGEST.search(line) or FINE_DECIMAL.search(line)) and not any(a in line for a in allowed):
                found.append(f"{name} [{index}]: {line.strip()[:160]}")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_compared_output_prints_trained_bits(path):
    assert machine_dependent(path.stem, json.loads(path.read_text())) == []


def cell(text: str, source: str = "print(x)") -> dict:
    return {"cell_type": "code", "source": [source], "outputs": [{"output_type": "stream", "text": [text]}]}


def test_the_scan_finds_what_984c965_stored():
    """05's exercise checker printed the replicas' digests after one step (they differed on an AMX Xeon); an all-digit
    digest counts too. Sanitized, ignored and listed outputs pass."""
    stored = "wrong: ...; after one step the replicas differ (weights 81379745 on rank 0, 11a1cf7a on rank 1)\n"
    assert len(machine_dependent("05_horovod", {"cells": [cell(stored)]})) == 1
    assert machine_dependent("05_horovod", {"cells": [cell("weights 81379745 on rank 0\n")]}) != []
    assert machine_dependent("05_horovod", {"cells": [cell("loss 0.123456789\n")]}) == []  # sanitized to D.DD
    assert machine_dependent("05_horovod", {"cells": [cell("rank 0: 23 steps, weights 490eadf4\n")]}) == []
    assert machine_dependent("05_horovod", {"cells": [cell(stored, "# NBVAL_IGNORE_OUTPUT\nprint(x)")]}) == []
    assert machine_dependent("05_horovod", {"cells": [cell("rank 0: 719 of 1438 training samples, weights "
                                                           "8dd3268d\n")]}) == []
    assert machine_dependent("03a_ddp_by_hand", {"cells": [cell("rank 0: 719 of 1438 training samples, weights "
                                                                "8dd3268d\n")]}) != []  # listed for 05 only


def test_every_listed_exception_is_still_printed():
    """An entry of INDEPENDENT whose line no longer appears is stale: remove it rather than let it excuse another."""
    for name, text, reason in INDEPENDENT:
        notebook = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
        assert any(text in out for _, out in compared_outputs(notebook)), (name, text, reason)


# A stored output that names a checkout's absolute path: a run's folder (…/notebooks/runs/…) or the venv (…/.venv/…).
CHECKOUT_PATH = re.compile(r"/[^\s'\"]*/(notebooks/runs|\.venv)/")


def test_no_stored_output_names_the_checkouts_absolute_path():
    """`make notebooks` stores runs/… and .venv/… (scripts/relative_outputs.py): what the slides and a learner see
    does not carry the maintainer's folders. Control: the rewrite's own input is found, its output is not."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("relative_outputs", ROOT / "scripts" / "relative_outputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = []
    for path in NOTEBOOKS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            for output in cell.get("outputs", []):
                text = json.dumps(output, ensure_ascii=False)  # every field: text, data of every type, evalue
                found += [f"{path.name} cell {i}: {m.group(0)}" for m in CHECKOUT_PATH.finditer(text)]
                found += [f"{path.name} cell {i}: {ROOT}/"] if f"{ROOT}/" in text else []
    assert not found, found
    printed = "reports are in /home/me/work/notebooks/runs/03/check; binary: /home/me/work/.venv/bin/python"
    assert len(CHECKOUT_PATH.findall(printed)) == 2
    assert module.relative(printed, "/home/me/work") == "reports are in runs/03/check; binary: .venv/bin/python"
    assert module.relative("/data/home/me/work/x.py", "/home/me/work") == "/data/home/me/work/x.py"  # not inside
