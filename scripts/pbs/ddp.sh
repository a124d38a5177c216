#!/bin/bash
# DDP on a ThetaGPU/Polaris-like PBS system: one process per GPU on every node of the job, through mpiexec.
#   qsub -A <project> -q <queue> -l select=2:ngpus=8 -l walltime=00:30:00 -l filesystems=home scripts/pbs/ddp.sh
# (Cobalt on the original ThetaGPU: qsub -n 2 -t 30 -q full-node -A <project> scripts/pbs/ddp.sh, with
#  COBALT_NODEFILE in place of PBS_NODEFILE.)
#PBS -N ddp
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-$(dirname "$0")/../..}"
source .venv/bin/activate                    # or: module load conda; conda activate dist-tutorial
NODEFILE=${PBS_NODEFILE:-${COBALT_NODEFILE:?no PBS_NODEFILE or COBALT_NODEFILE: run this through qsub}}
NNODES=$(sort -u "$NODEFILE" | wc -l)
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# tutorial.core.distributed reads the rank from PALS/PMI/Open MPI variables and rank 0 broadcasts a free port with mpi4py;
# MASTER_ADDR is the first node of the job. Use the high-speed interface for NCCL, not the management network:
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-hsn0,ib0}
mpiexec -n $((NNODES * GPUS_PER_NODE)) --ppn "$GPUS_PER_NODE" --hostfile "$NODEFILE" --cpu-bind depth --depth 8 \
  python -m tutorial.train_ddp --preset workshop --data-dir "${DATA_DIR:-data}" --out "runs/ddp-${PBS_JOBID:-manual}"
