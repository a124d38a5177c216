"""examples/ddp_standalone.py, the DDP script README tells people to copy: it stands alone and trains correctly."""
from __future__ import annotations

import ast
import json
import math

import pytest
import torch
from conftest import PYTHON, ROOT, run

EXAMPLE = ROOT / "examples" / "ddp_standalone.py"


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_standalone")
    run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", EXAMPLE, "--out", out])
    return out, json.loads((out / "result.json").read_text())


def test_it_imports_nothing_from_this_repository():
    imported = set()
    for node in ast.walk(ast.parse(EXAMPLE.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or ".").split(".")[0])
    assert imported <= {"argparse", "hashlib", "json", "os", "torch", "sklearn"}, imported


def test_two_processes_train_identical_replicas_on_half_the_data_each(result):
    out, r = result
    assert r["world_size"] == 2 and len(r["checksums"]) == 2
    assert r["checksums"][0] == r["checksums"][1], "the replicas differ"
    assert r["samples_seen"] == [r["epochs"] * math.ceil(r["train_size"] / 2)] * 2  # DistributedSampler's share
    assert r["test_accuracy"] >= 0.85  # notebook 03's bar for the capstone (0.889 measured on a CPU)


def test_rank_0_saved_the_unwrapped_model_it_reported(result):
    out, r = result
    state = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    assert not any(k.startswith("module.") for k in state), "saved the DDP wrapper, not the model"
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model.load_state_dict(state)
    from sklearn.datasets import load_digits
    X, y = load_digits(return_X_y=True)
    X, y = torch.tensor(X[1437:], dtype=torch.float32) / 16, torch.tensor(y[1437:])
    with torch.no_grad():
        assert (model(X).argmax(1) == y).float().mean().item() == pytest.approx(r["test_accuracy"])
