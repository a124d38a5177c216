#!/bin/bash -l
# Horovod on Polaris (ALCF): PBS Pro, 4 A100 per node, Cray MPICH's mpiexec (PALS). One rank per GPU on every node.
#   qsub -A <project> scripts/pbs/polaris/horovod.sh
# Horovod must be built with NCCL on a GPU node (HOROVOD_GPU_OPERATIONS=NCCL; make install does). Its last release is
# 0.28.1 (2023): DDP (scripts/pbs/polaris/ddp.sh) is the maintained path.
#PBS -N horovod
#PBS -q debug
#PBS -l select=2:system=polaris
#PBS -l place=scatter
#PBS -l walltime=00:30:00
#PBS -l filesystems=home:eagle
#PBS -j oe
set -eo pipefail
if [[ ! -r "${PBS_NODEFILE:-}" ]]; then
  echo "PBS_NODEFILE='${PBS_NODEFILE:-}' is not a readable file: submit this script with qsub" >&2
  exit 2
fi
cd "${PBS_O_WORKDIR:-$(dirname "$0")/../../..}"
module use /soft/modulefiles
module load conda                       # see ddp.sh: ALCF's PyTorch and NCCL settings, the course's venv on top
source "${VENV:-.venv}/bin/activate"
set -u                                  # after: module and conda scripts are not written for -u

NNODES=$(sort -u "$PBS_NODEFILE" | wc -l)
GPUS_PER_NODE=4
# As in ddp.sh: local rank i on cores 8i..8i+7, and GPU 3-i, the one nearest them (the trainer takes visible GPU
# hvd.local_rank()). No NCCL_SOCKET_IFNAME: see ddp.sh for when to set one.
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-3,2,1,0}
# MPI connects the ranks: Horovod needs no address or port.
mpiexec -n $((NNODES * GPUS_PER_NODE)) --ppn "$GPUS_PER_NODE" --depth 8 --cpu-bind depth --hostfile "$PBS_NODEFILE" \
  python -m tutorial.train_horovod --preset "${PRESET:-workshop}" --data-dir "${DATA_DIR:-data}" \
  --out "${OUT:-runs/hvd-${PBS_JOBID:-manual}}"
