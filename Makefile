# The workbook's commands. `make lab` and `make test` are the two a person needs; both install first.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= python3
VENV ?= .venv
PORT ?= 8888
# 127.0.0.1 keeps the lab private to this machine; on a compute node reach it with an ssh tunnel (README).
LAB_IP ?= 127.0.0.1
HOROVOD_GPU_OPERATIONS ?=
NBVAL_TIMEOUT ?= 600
export PYTHON VENV HOROVOD_GPU_OPERATIONS
BIN := $(VENV)/bin
# One test at a time. Two pytest-xdist workers were tried (2026-11-25): 14 min instead of 26 for the unit tests on
# this 2-core machine, but in CI the strict nbval lane took 22 min on two workers against 14 on one and a timing
# check failed: the tests launch 2-4 processes each, so two at once oversubscribe two cores.
# Strict nbval as users type it (pytest --nbval notebooks/); notebooks/conftest.py pins the preset the stored outputs
# were made with and the sanitizer, so the Makefile adds only the cell timeout.
NBVAL = $(BIN)/python -m pytest --nbval notebooks/ --nbval-cell-timeout $(NBVAL_TIMEOUT)
# The second lane: every notebook top to bottom with the workshop preset's code paths on a CPU (workshop-cpu), every
# assert holding, outputs not compared (they differ from the stored smoke outputs by design). notebook.allocation
# takes its no-GPU branch here; make gpu-check runs the one-GPU and full-node branches where there are GPUs.
LANE_NOTEBOOKS ?= $(wildcard notebooks/[0-9][0-9]*_*.ipynb)
WORKSHOP_LANE = TUTORIAL_PRESET=workshop-cpu $(BIN)/python -m pytest --nbval-lax $(LANE_NOTEBOOKS) \
	--nbval-cell-timeout $(NBVAL_TIMEOUT)

.PHONY: help install lab test unit nbval workshop-lane notebooks slides bench gpu-check doctor clean check-vars

help:
	@echo "make lab        set up if needed, then JupyterLab on notebooks/ (token auth, prints the URL)"
	@echo "make test       set up if needed, then unit tests, pytest --nbval notebooks/, the workshop-cpu lane"
	@echo "make install    system MPI, .venv (pinned), Horovod (built, cached), the 'tutorial' kernel"
	@echo "make notebooks  re-execute every notebook in place to refresh stored outputs (CPU preset)"
	@echo "make slides     one reveal.js deck per notebook in slides/: speaker notes, fits the screen, opens offline"
	@echo "make bench      throughput, all-reduce and trainer-vs-bare-loop benchmarks, appended to results/"
	@echo "make gpu-check  on a GPU machine: every trainer (FSDP, DeepSpeed, Lightning too), NCCL, Horovod+NCCL, the"
	@echo "                notebooks (workshop) on one GPU and on all, ResNet-50; ARGS=--list shows the checks"
	@echo "make doctor     what is installed and whether the workbook can run here"

check-vars:
	@case "$(HOROVOD_GPU_OPERATIONS)" in ""|NCCL) ;; *) echo "error: HOROVOD_GPU_OPERATIONS=$(HOROVOD_GPU_OPERATIONS) is not supported; use NCCL or leave it unset" >&2; exit 2;; esac
	@case "$(PORT)" in ''|*[!0-9]*) echo "error: PORT=$(PORT) is not a port number; use e.g. PORT=8888" >&2; exit 2;; esac

install: check-vars
	@bash scripts/install.sh

doctor: install
	@$(BIN)/tutorial doctor

lab: install
	@bash scripts/lab.sh "$(LAB_IP)" "$(PORT)"

unit: install
	$(BIN)/python -m pytest tests

nbval: install
	$(NBVAL)

test: install
	$(BIN)/python -m pytest tests
	$(NBVAL)
	$(WORKSHOP_LANE)
	@bash scripts/check_leftovers.sh

workshop-lane: install
	$(WORKSHOP_LANE)

notebooks: install
	@bash scripts/run_notebooks.sh

slides: install
	@bash scripts/slides.sh

# The last two print and record trainer step time / hand-written loop step time for single, DDP and Horovod (issue 15).
bench: install
	$(BIN)/tutorial bench allreduce --backend gloo --nproc 2
	$(BIN)/tutorial bench train --strategy ddp --nproc 2 --preset smoke
	$(BIN)/python benchmarks/bare_loop.py --threads 1 --stage single,ddp,horovod --nproc 2
	$(BIN)/python benchmarks/bare_loop.py --threads 1 --stage single,ddp,horovod --nproc 2 --dataset synthetic \
		--model resnet18 --batch-size 8 --warmup 3 --steps 10 --repeats 6
	$(BIN)/python benchmarks/bare_loop.py --threads 1 --stage single,ddp --nproc 2 --instructions --warmup 2 \
		--steps 10
	$(BIN)/python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/pipeline_bubble.py

# Not behind `install`: it must also run on a bare GPU machine with torch only (scripts/gpu_check.sh says how).
gpu-check:
	@bash scripts/gpu_check.sh $(ARGS)

clean:
	rm -rf runs slides/*.html .pytest_cache
