#!/bin/bash
# Horovod on a PBS cluster whose MPI is Open MPI (ThetaGPU-like: 8 A100 per node). One rank per GPU on every node.
#   qsub -A <project> -q <queue> scripts/pbs/openmpi/horovod.sh
# Horovod must be built with NCCL on a GPU node (HOROVOD_GPU_OPERATIONS=NCCL; make install does). Its last release is
# 0.28.1 (2023): DDP (scripts/pbs/openmpi/ddp.sh) is the maintained path.
#PBS -N horovod
#PBS -l select=2:ngpus=8:mpiprocs=8
#PBS -l place=scatter:excl
#PBS -l walltime=00:30:00
#PBS -j oe
set -eo pipefail
if [[ ! -r "${PBS_NODEFILE:-}" ]]; then
  echo "PBS_NODEFILE='${PBS_NODEFILE:-}' is not a readable file: submit this script with qsub" >&2
  exit 2
fi
cd "${PBS_O_WORKDIR:-$(dirname "$0")/../../..}"
source "${VENV:-.venv}/bin/activate"
set -u

NNODES=$(sort -u "$PBS_NODEFILE" | wc -l)
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# As in ddp.sh: pass the set variables to the other nodes; no NCCL_SOCKET_IFNAME unless NCCL picks a wrong network.
exports=()
for name in PATH LD_LIBRARY_PATH VIRTUAL_ENV PYTHONPATH CUDA_VISIBLE_DEVICES OMP_NUM_THREADS \
            NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_DEBUG NCCL_IB_HCA; do
  if printenv "$name" >/dev/null; then exports+=(-x "$name"); fi
done
# Horovod's documented Open MPI flags: -bind-to none -map-by slot. MPI connects the ranks: no address or port.
mpirun -np $((NNODES * GPUS_PER_NODE)) -npernode "$GPUS_PER_NODE" -hostfile "$PBS_NODEFILE" -bind-to none -map-by slot \
  "${exports[@]}" \
  python -m tutorial.train_horovod --preset "${PRESET:-workshop}" --data-dir "${DATA_DIR:-data}" \
  --out "${OUT:-runs/hvd-${PBS_JOBID:-manual}}"
# Or Horovod's own launcher (ssh to each node):  horovodrun -np 16 -H node1:8,node2:8 python -m tutorial.train_horovod
