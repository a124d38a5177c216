#!/bin/bash
# DDP on a PBS cluster whose MPI is Open MPI (ThetaGPU-like: 8 A100 per node). One rank per GPU on every node.
# Submit from the checkout; the #PBS lines below are defaults that qsub options override:
#   qsub -A <project> -q <queue> scripts/pbs/openmpi/ddp.sh
#   qsub -A <project> -q <queue> -l select=4:ngpus=8:mpiprocs=8 scripts/pbs/openmpi/ddp.sh       (4 nodes)
# Nodes with 4 GPUs: qsub -v GPUS_PER_NODE=4 -l select=2:ngpus=4:mpiprocs=4 ... Polaris (Cray PALS mpiexec):
# scripts/pbs/polaris/ddp.sh.
#PBS -N ddp
#PBS -l select=2:ngpus=8:mpiprocs=8
#PBS -l place=scatter:excl
#PBS -l walltime=00:30:00
#PBS -j oe
set -eo pipefail
if [[ ! -r "${PBS_NODEFILE:-}" ]]; then
  echo "PBS_NODEFILE='${PBS_NODEFILE:-}' is not a readable file: submit this script with qsub" >&2
  exit 2
fi
cd "${PBS_O_WORKDIR:-$(dirname "$0")/../../..}"   # qsub's folder: the checkout
source "${VENV:-.venv}/bin/activate"               # or your site's module/conda environment
set -u

# PBS_NODEFILE lists each node once per MPI process of its chunk (mpiprocs=8: 8 lines), which Open MPI reads as
# 8 slots per node; sort -u counts the nodes.
NNODES=$(sort -u "$PBS_NODEFILE" | wc -l)
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# Open MPI gives the ranks on other nodes only the variables named with -x; name those that are set here (an unset
# name only draws a warning). NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME are not set by this script: NCCL and gloo
# pick an interface themselves, and a wrong default (an interface a node lacks) fails the run. Export one before
# qsub -V, or here, only if NCCL_DEBUG=INFO shows the bootstrap on a network the other nodes cannot reach (a hang in
# the first collective); `ip -br addr` on a compute node lists the interfaces (ib0 on InfiniBand, for example).
exports=()
for name in PATH LD_LIBRARY_PATH VIRTUAL_ENV PYTHONPATH CUDA_VISIBLE_DEVICES OMP_NUM_THREADS \
            NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_DEBUG NCCL_IB_HCA; do
  if printenv "$name" >/dev/null; then exports+=(-x "$name"); fi
done
# -npernode: one rank per GPU on each node. -bind-to none: by default Open MPI binds each rank to a socket (more than
# 2 ranks), and its DataLoader workers inherit that; unbound, they spread over the node's cores.
# The trainer reads its rank from OMPI_COMM_WORLD_RANK/_LOCAL_RANK/_SIZE/_LOCAL_SIZE, takes GPU <local rank>, and
# rank 0 sends its host and a free port to the others with mpi4py.
mpirun -np $((NNODES * GPUS_PER_NODE)) -npernode "$GPUS_PER_NODE" -hostfile "$PBS_NODEFILE" -bind-to none \
  "${exports[@]}" \
  python -m tutorial.train_ddp --preset "${PRESET:-workshop}" --data-dir "${DATA_DIR:-data}" \
  --out "${OUT:-runs/ddp-${PBS_JOBID:-manual}}"
# torchrun instead, one per node (it starts the ranks and numbers them; no MPI needed in the trainer):
#   mpirun -np "$NNODES" -npernode 1 -hostfile "$PBS_NODEFILE" -bind-to none "${exports[@]}" \
#     torchrun --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" --rdzv_backend c10d \
#     --rdzv_endpoint "$(head -n 1 "$PBS_NODEFILE"):29500" --rdzv_id "$PBS_JOBID" -m tutorial.train_ddp
