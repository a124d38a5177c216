# The workbook's commands. `make lab` and `make test` are the two a person needs; both install first.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= python3
VENV ?= .venv
PORT ?= 8888
# 127.0.0.1 keeps the lab private to this machine; on a compute node reach it with an ssh tunnel (README).
LAB_IP ?= 127.0.0.1
HOROVOD_GPU_OPERATIONS ?=
# SITE_TORCH=1 make install: keep the site's torch (Intel XPU, AMD ROCm) instead of PyPI's CUDA build (install.sh)
SITE_TORCH ?=
NBVAL_TIMEOUT ?= 600
export PYTHON VENV HOROVOD_GPU_OPERATIONS SITE_TORCH
BIN := $(VENV)/bin
# Where make test records its times (scripts/suite_times.py): each lane's wall time, and through --junitxml every
# test's and notebook cell's duration; the report at its end prints the halves' balance and the slowest tests.
TIMES := results/test-times
TIMED = $(PYTHON) scripts/suite_times.py run
# make test runs its two halves side by side: the unit tests, and the notebooks (strict nbval, the simulated-GPU lane,
# then the floor lane's tests on the oldest torch). Most tests and cells wait on process starts, rendezvous and sleeps
# as much as they compute, so the halves fill each other's gaps (each lane records the machine's busy share: how much
# a third job could still use); results/suite_times.md holds fresh clones' figures on the slowest machine seen.
# Two notebooks at once are avoided (pytest-xdist, tried: the lanes share run folders and ports, and 01's
# loader-workers check failed), and so are two launches of the same notebook.
# Strict nbval as users type it (pytest --nbval notebooks/); notebooks/conftest.py pins the preset the stored outputs
# were made with and the sanitizer, so the Makefile adds only the cell timeout.
NBVAL = $(BIN)/python -m pytest --nbval notebooks/ --nbval-cell-timeout $(NBVAL_TIMEOUT)
# The second lane: the GPU branch of every numbered notebook, on simulated GPUs (tests/simgpu: torch.cuda's answers,
# tensors that say cuda:N and fail on mixed devices as CUDA does, NCCL over gloo that refuses what NCCL refuses, and a
# record of every process group checked against README's allocation table). All but the four named below run as a
# one-GPU attendee's (the row most attendees have, and the one with most branches: ranks sharing the GPU over gloo,
# or moved to the CPU), all but the launches a cell hides from the GPU, which strict nbval runs as a GPU node would
# (lane.py ONE_GPU_HIDDEN); the notebooks whose lessons change with NCCL run again on a full node of 8 GPUs (the
# seeds' ThetaGPU node): 00's first all-reduce, 01's trainer with every GPU visible, 03a's process group and comm hooks by
# hand, 03b's SyncBatchNorm, 07's all-reduce sweep and DDP step on 8 engines (smoke preset), 08's plain Lightning
# script and 10's flight recorder; of 01, 03b, 07, 08 and 10 only the cells whose groups or devices change with it
# (tests/simgpu/lane.py FULL_NODE_CELLS: 8 min for 08 and 10 whole, under load). The workshop-cpu preset, so that the
# workshop preset's code paths run too (what the workshop-cpu lane on the CPU did before: the ranks that the
# allocation moves to the CPU still run it there).
# --nbval-lax: every assert holds, outputs are not compared (the allocation lines differ from the stored ones).
SIMGPU = TUTORIAL_PRESET=workshop-cpu PYTHONPATH=$(CURDIR)/tests/simgpu $(BIN)/python -m pytest -p lane \
	--nbval-lax --nbval-cell-timeout $(NBVAL_TIMEOUT)
# 04 and 09 run on the CPU with workshop-cpu, as the lane did before. 04 counts the graphs torch.compile makes, and
# the simulation compiles nothing (there is no GPU to generate kernels for). FSDP2 and DCP make tensors below torch's
# Python layer, which the simulation cannot follow (a resumed FSDP run's BatchNorm buffers come back as CPU tensors
# there). Their GPU branches are gpu-check's (its compile, bf16/fp16, FSDP and DeepSpeed checks).
CPU_LANE_NOTEBOOKS = notebooks/04_mixed_precision.ipynb notebooks/09_sharded_training.ipynb
# In no lane, strict nbval only:
# - 06: its launches are typed with `--preset smoke` (strict nbval runs them), and what they do on one GPU is the
#   trainers' own decisions, which 03b, 05 and tests/test_simulated_gpus.py run on simulated GPUs.
# - 12: its cells read the preset only to name it, so a CPU run with workshop-cpu repeated strict nbval. Its ranks
#   train FSDP2 (on the CPU for a one-GPU attendee anyway), and its layout dry run builds FSDP2 on the meta device,
#   which the simulation cannot follow (the cell hung past 600 s, 2026-11-27): its GPU branch is gpu-check's stage 6.
NO_LANE_NOTEBOOKS = notebooks/06_multi_node.ipynb notebooks/12_performance_clinic.ipynb
ONE_GPU_NOTEBOOKS ?= $(filter-out $(CPU_LANE_NOTEBOOKS) $(NO_LANE_NOTEBOOKS),$(wildcard notebooks/[0-9][0-9]*_*.ipynb))
FULL_NODE_NOTEBOOKS ?= notebooks/00_setup.ipynb notebooks/01_single_device.ipynb notebooks/03a_ddp_by_hand.ipynb \
	notebooks/03b_ddp_trainer.ipynb notebooks/07_scaling_study.ipynb notebooks/08_lightning.ipynb \
	notebooks/10_when_things_go_wrong.ipynb
# JUnit XML of one pytest run, beside the lane times (scripts/suite_times.py reads both).
junit = --junitxml=$(TIMES)/$(1).xml -o junit_family=xunit2
SIMGPU_ONE_GPU = env TUTORIAL_SIMGPU=1 TUTORIAL_SIMGPU_CELLS=one-gpu $(SIMGPU) $(call junit,simgpu-1gpu) $(ONE_GPU_NOTEBOOKS)
SIMGPU_FULL_NODE = env TUTORIAL_SIMGPU=8 TUTORIAL_SIMGPU_CELLS=full-node $(SIMGPU) $(call junit,simgpu-8gpu) $(FULL_NODE_NOTEBOOKS)
SIMGPU_CPU_PART = env TUTORIAL_PRESET=workshop-cpu $(BIN)/python -m pytest --nbval-lax $(CPU_LANE_NOTEBOOKS) \
	--nbval-cell-timeout $(NBVAL_TIMEOUT) $(call junit,simgpu-cpu)
# The same GPU branches on an AMD node (TUTORIAL_SIMGPU_VENDOR=rocm: a ROCm build, RCCL under NCCL's name, GPUs picked
# by ROCR_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES on top of it) and an Intel node (xpu: an XPU build, "xpu" tensors,
# oneCCL's xccl, tiles picked by ZE_AFFINITY_MASK and hidden by ONEAPI_DEVICE_SELECTOR, "cuda" refused), where the
# engines' placement and hiding, the backend and the device type differ from NVIDIA's: 00, 03a and the full-node cells
# of 03b and 10 on a full node (8 GCDs; Aurora's 12 tiles), and 00 (the doctor) on one Intel tile, where every rank
# goes to the CPU (gloo has no XPU tensors). AMD's one-GPU row is NVIDIA's, with ROCm's variables
# (test_simulated_gpus.py's AMD node picks and hides by them).
vendor_run = env TUTORIAL_SIMGPU_VENDOR=$(1) TUTORIAL_SIMGPU=$(2) TUTORIAL_SIMGPU_CELLS=$(3) $(SIMGPU) \
	$(call junit,simgpu-$(1)-$(2)gpu) $(4)
VENDOR_NOTEBOOKS = notebooks/00_setup.ipynb notebooks/03a_ddp_by_hand.ipynb notebooks/03b_ddp_trainer.ipynb \
	notebooks/10_when_things_go_wrong.ipynb
SIMGPU_VENDORS = $(call vendor_run,rocm,8,full-node,$(VENDOR_NOTEBOOKS)) && \
	$(call vendor_run,xpu,1,one-gpu,notebooks/00_setup.ipynb) && $(call vendor_run,xpu,12,full-node,$(VENDOR_NOTEBOOKS))
SIMGPU_LANE = $(SIMGPU_ONE_GPU) && $(SIMGPU_FULL_NODE) && $(SIMGPU_VENDORS) && $(SIMGPU_CPU_PART)

# The floor lane: the trainers' core paths and gpu-check's CPU rehearsal on the oldest torch the workbook supports
# (pyproject.toml's "torch>=", the one place it is declared; the lent GPU node has 2.11), in .venv-floor, an overlay of
# .venv that make install makes (scripts/torch_floor.sh). It ends the notebooks' half: fc5 of 22e90d0 (2026-11-29, AVX2
# EPYC) measured the unit lane alone at 53.5 min beside 53.6 of notebooks, before 04's timings, the one-GPU lane's
# hidden launches and 06's repeated unit tests came out (about 6.4 min of the notebooks' half, 1.1 of the unit's).
FLOOR_TESTS = tests/test_distributed.py tests/test_step_agreement.py tests/test_trainers.py \
	tests/test_gpu_check.py::test_the_cpu_rehearsal_of_stage_1
FLOOR_LANE = .venv-floor/bin/python -m pytest $(FLOOR_TESTS) $(call junit,floor)
# gpu-check's CPU rehearsal runs once in make test, on the floor: the torch of the lent GPU node, where its checks
# will run (62 s in the unit lane and 80 s in the floor lane when it ran in both, 2026-11-29); the trainers' paths on
# the pinned torch are test_trainers' and the notebooks'. `pytest tests` still runs it.
UNIT_LANE = $(BIN)/python -m pytest tests --deselect tests/test_gpu_check.py::test_the_cpu_rehearsal_of_stage_1 \
	$(call junit,unit)

.PHONY: help install lab hub hub-rehearsal test test-unit test-notebooks unit nbval simgpu-lane floor-lane soak host-syncs notebooks slides bench gpu-check gpu-bundle doctor clean check-vars

help:
	@echo "make lab        set up if needed, then JupyterLab on notebooks/ (token auth, prints the URL)"
	@echo "make hub        as root: the workshop's hub rehearsed on virtual nodes with Slurm (HUB_ATTENDEES=alice,bob)"
	@echo "make hub-rehearsal  as root: 12 attendees start their labs at once, then a node is lost; times to results/hub/hub_load.jsonl"
	@echo "make test       set up if needed, then unit tests, pytest --nbval notebooks/, the simulated-GPU lane"
	@echo "make install    system MPI, .venv (pinned), Horovod (built, cached), the 'tutorial' kernel"
	@echo "make notebooks  re-execute every notebook in place to refresh stored outputs (CPU preset)"
	@echo "make slides     one reveal.js deck per notebook in slides/: speaker notes, fits the screen, opens offline"
	@echo "make bench      throughput, all-reduce and trainer-vs-bare-loop benchmarks, appended to results/"
	@echo "make gpu-check  on a GPU node, STAGE=1..6 (8 min each; 1 and 2 first): trainers, NCCL, notebooks, ResNet-50;"
	@echo "                RESULTS=DIR for the results; ARGS=--list shows a stage's checks and estimates"
	@echo "make gpu-bundle where there is internet: the pinned wheels an offline GPU node lacks, into .whl/ (<= 60 MiB)"
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

# The workshop's hub (tools/hub) rehearsed on this machine, as root: virtual nodes with a real Slurm, the hub on node1,
# each attendee's lab a Slurm job; http://127.0.0.1:$(HUB_PORT). HUB_ATTENDEES=alice,bob makes (and removes) accounts.
HUB_PORT ?= 8000
HUB_ATTENDEES ?=
hub: install
	@PYTHONPATH=tools $(BIN)/python -m hub.rehearsal --port "$(HUB_PORT)" --attendees "$(HUB_ATTENDEES)"

# The hub at a workshop's scale (tools/hub/load.py): 12 attendees log in and start their labs within the same minute
# on 3 virtual nodes of 4 GPUs, some waiting in the queue behind an earlier job; then node3 is lost and its labs start
# again; prints each lab's spawn time, the median and the worst, how soon the lost labs were noticed and started
# again, and appends them to results/hub/hub_load.jsonl. HUB_REHEARSAL_ARGS="--attendees 20 --nodes 5" (--no-lose-node).
HUB_REHEARSAL_ARGS ?=
hub-rehearsal: install
	@PYTHONPATH=tools $(BIN)/python -m hub.load $(HUB_REHEARSAL_ARGS)

unit: install
	$(BIN)/python -m pytest tests

nbval: install
	$(NBVAL)

test: install
	@rm -rf $(TIMES)
	@$(TIMED) test all -- $(MAKE) --no-print-directory -j2 --output-sync=target test-unit test-notebooks; \
		status=$$?; $(PYTHON) scripts/suite_times.py report; exit $$status
	@bash scripts/check_leftovers.sh

# make test's two halves (each prints when it ends: --output-sync keeps their lines apart); no install of their own,
# which two parallel jobs would race. Every lane is timed and every pytest writes its JUnit XML into $(TIMES), so the
# report at the end of make test says how long each lane and half took and which tests and cells were the slowest:
# balance the halves from those figures (results/suite_times.md holds a fresh clone's).
test-unit:
	$(TIMED) unit unit -- $(UNIT_LANE)

test-notebooks:
	$(TIMED) nbval notebooks -- $(NBVAL) $(call junit,nbval)
	$(TIMED) simgpu-1gpu notebooks -- $(SIMGPU_ONE_GPU)
	$(TIMED) simgpu-8gpu notebooks -- $(SIMGPU_FULL_NODE)
	$(TIMED) simgpu-vendors notebooks -- bash -c '$(SIMGPU_VENDORS)'
	$(TIMED) simgpu-cpu notebooks -- $(SIMGPU_CPU_PART)
	$(TIMED) floor notebooks -- $(FLOOR_LANE)

simgpu-lane: install
	$(SIMGPU_LANE)

floor-lane: install
	$(FLOOR_LANE)

# The rendezvous soak at its full size (4 attendees x 10 rounds beside torchrun); make test runs 2 x 3.
soak: install
	TUTORIAL_SOAK=1 $(BIN)/python -m pytest -s tests/test_races.py::test_attendees_rendezvous_at_once_beside_torchrun

# Host syncs per training step of every one-process trainer on a simulated GPU, appended to results/host_syncs.jsonl.
host-syncs: install
	cd tests/simgpu && TUTORIAL_SIMGPU=1 PYTHONPATH=. $(CURDIR)/$(BIN)/python -m host_syncs --results $(CURDIR)/results

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

# Not behind `install`: it must also run on an offline GPU node with only its own torch and the wheels of
# `make gpu-bundle` (scripts/gpu_check.sh says how). One stage per call, at most 8 minutes each.
STAGE ?= 1
RESULTS ?= results
gpu-check:
	@bash scripts/gpu_check.sh --stage $(STAGE) --results-dir $(RESULTS) $(ARGS)

gpu-bundle:
	@bash scripts/gpu_bundle.sh

clean:
	rm -rf runs slides/*.html .pytest_cache
