"""pytest configuration for `pytest --nbval notebooks/`, typed as-is from the repository root.

Strict nbval compares the stored outputs, which were made on a CPU with the `smoke` preset, so both are pinned
here whatever the machine (GPUs hidden); varying text (timings, throughputs) is rewritten by sanitize.cfg before comparing.
`pytest --nbval-lax` (the simulated-GPU lane of `make test`) only runs the cells and their asserts, so
it keeps whatever TUTORIAL_PRESET the caller chose.
"""
import os
from pathlib import Path

STORED_OUTPUTS_PRESET = "smoke"
# Strict nbval compares under other math kernels than `make notebooks` stored the outputs with, so that an output
# which prints the last bits of a trained value fails on the machine that made it, not only on the next CI machine
# (tests/test_stored_outputs.py says why they differ). MKL's COMPATIBLE branch changes MKL's sums on every x86 CPU
# (on AMD processors it is the only setting MKL honours); the two caps change oneDNN's convolutions and ATen's vector
# reductions on AVX-512 machines and change nothing on AVX2-only ones.
ROUNDING_PERTURBATION = {"MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def pytest_configure(config):
    if not (config.option.nbval or config.option.nbval_lax):
        return
    if config.option.nbval:
        os.environ["TUTORIAL_PRESET"] = STORED_OUTPUTS_PRESET
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the stored outputs were made on a CPU; a GPU changes what prints
        for name, value in ROUNDING_PERTURBATION.items():
            os.environ.setdefault(name, value)
    if not config.option.nbval_sanitize_with:
        config.option.nbval_sanitize_with = str(Path(__file__).with_name("sanitize.cfg"))
    # The kernels inherit this environment: ipyparallel's progress bars and INFO lines would make outputs vary, and
    # OpenMP threads and Open MPI ranks that spin while they wait burn the CPU the next rank needs (tests/conftest.py
    # has the figures).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    os.environ.setdefault("CI", "true")


def pytest_collection_modifyitems(config, items):
    """A notebook cell may train for minutes on a busy 2-core machine (the unit tests' 300 s limit is too short)."""
    import pytest
    for item in items:
        item.add_marker(pytest.mark.timeout(1800))
