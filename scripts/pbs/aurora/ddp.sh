#!/bin/bash -l
# DDP on Aurora (ALCF): PBS Pro, 6 Intel Data Center GPU Max 1550 per node with 2 tiles each, Cray PALS's mpiexec.
# One rank per tile: 12 ranks per node, each seeing one tile (gpu_tile.sh sets its ZE_AFFINITY_MASK).
#   qsub -A <project> scripts/pbs/aurora/ddp.sh
#   qsub -A <project> -q prod -l select=32 scripts/pbs/aurora/ddp.sh      (32 nodes, 384 ranks)
# Each rank trains on xpu:0, the one tile it sees (tutorial.core.distributed.pick_device asks core.accelerator), and
# --backend auto takes torch's default for that device, oneCCL's "xccl" (dist.get_default_backend_for_device("xpu"),
# recent torch XPU builds). Untested on an XPU: no Intel GPU has run the course yet, and the trainers' other GPU
# branches (mixed precision, memory figures) are written and checked for CUDA.
#PBS -N ddp
#PBS -q debug
#PBS -l select=2
#PBS -l place=scatter
#PBS -l walltime=00:30:00
#PBS -l filesystems=home:flare
#PBS -j oe
set -eo pipefail
if [[ ! -r "${PBS_NODEFILE:-}" ]]; then
  echo "PBS_NODEFILE='${PBS_NODEFILE:-}' is not a readable file: submit this script with qsub" >&2
  exit 2
fi
cd "${PBS_O_WORKDIR:-$(dirname "$0")/../../..}"   # qsub's folder: the checkout
# ALCF's PyTorch for XPU (with oneCCL) comes from the frameworks module; the course's packages sit in a venv on top,
# made once on a login node: module load frameworks; python -m venv --system-site-packages .venv;
# .venv/bin/pip install -e .
module load frameworks
source "${VENV:-.venv}/bin/activate"
set -u                                  # after: module scripts are not written for -u

NNODES=$(sort -u "$PBS_NODEFILE" | wc -l)
TILES_PER_NODE=12
# Two sockets of 52 cores, 6 tiles each; cores 0 and 52 are left to the OS. Local rank i gets the i-th block of 8
# cores (its DataLoader workers share them), and tiles 0-5 (GPUs 0-2) sit on socket 0, 6-11 on socket 1.
CPU_BIND=list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100
# oneCCL as ALCF recommends for PyTorch DDP on Aurora: MPI starts the ranks and carries oneCCL's key-value exchange,
# libfabric's cxi provider drives the Slingshot network. These are site settings: check them against ALCF's current
# Aurora PyTorch docs (docs.alcf.anl.gov, "PyTorch on Aurora"), which change with the frameworks module.
export CCL_PROCESS_LAUNCHER=${CCL_PROCESS_LAUNCHER:-pmix}
export CCL_ATL_TRANSPORT=${CCL_ATL_TRANSPORT:-mpi}
export CCL_KVS_MODE=${CCL_KVS_MODE:-mpi}
export FI_PROVIDER=${FI_PROVIDER:-cxi}
# torch's rendezvous on the first node, at a port of this job's own (as the trainer derives one under Slurm); with
# both set, tutorial.core.distributed uses them and needs no mpi4py. Set MASTER_PORT yourself if that one is taken.
jobnum=${PBS_JOBID%%[!0-9]*}
export MASTER_ADDR=${MASTER_ADDR:-$(head -n 1 "$PBS_NODEFILE")}
export MASTER_PORT=${MASTER_PORT:-$((20000 + 10#${jobnum:-0} % 20000))}
# The trainer reads its rank from PALS (PALS_RANKID, PALS_LOCAL_RANKID, PMI_SIZE, PALS_LOCAL_SIZE): nothing to export.
mpiexec -n $((NNODES * TILES_PER_NODE)) --ppn "$TILES_PER_NODE" --cpu-bind "$CPU_BIND" --hostfile "$PBS_NODEFILE" \
  scripts/pbs/aurora/gpu_tile.sh \
  python -m tutorial.train_ddp --preset "${PRESET:-workshop}" --data-dir "${DATA_DIR:-data}" \
  --out "${OUT:-runs/ddp-${PBS_JOBID:-manual}}"
