#!/bin/bash -l
# DDP on Polaris (ALCF): PBS Pro, 4 A100 per node, Cray MPICH's mpiexec (PALS). One rank per GPU on every node.
# Submit from the checkout, naming your project; the #PBS lines below are defaults that qsub options override:
#   qsub -A <project> scripts/pbs/polaris/ddp.sh
#   qsub -A <project> -q prod -l select=10:system=polaris scripts/pbs/polaris/ddp.sh      (10 nodes, 40 GPUs)
# Open MPI sites with 8 GPUs per node: scripts/pbs/openmpi/ddp.sh.
#PBS -N ddp
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
cd "${PBS_O_WORKDIR:-$(dirname "$0")/../../..}"   # qsub's folder: the checkout
# ALCF's PyTorch, and NCCL configured for the Slingshot network (its libfabric plugin). The course's packages sit in a
# venv on top, made once on a login node: module use /soft/modulefiles; module load conda; conda activate;
# python -m venv --system-site-packages .venv; .venv/bin/pip install -e .
module use /soft/modulefiles
module load conda
source "${VENV:-.venv}/bin/activate"
set -u                                  # after: module and conda scripts are not written for -u

# PBS_NODEFILE lists the job's nodes (one line per node with Polaris's select=N:system=polaris).
NNODES=$(sort -u "$PBS_NODEFILE" | wc -l)
GPUS_PER_NODE=4
# --depth 8 --cpu-bind depth: local rank i runs on cores 8i..8i+7, the block of cores its DataLoader workers share.
# On Polaris GPU 0 sits next to cores 24-31 and GPU 3 next to cores 0-7 (ALCF's GPU affinity notes), and the trainer
# takes visible GPU <local rank> (tutorial.core.distributed.pick_device): listing the GPUs in reverse gives every rank
# the GPU nearest its cores. All four stay visible to every rank: train_ddp checks that a node's ranks have a GPU
# each, which one visible GPU per rank (ALCF's set_affinity_gpu_polaris.sh) would fail.
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-3,2,1,0}
# NCCL_SOCKET_IFNAME is not set on purpose: the conda module configures NCCL for Slingshot, and NCCL's bootstrap
# picks a usable interface itself. Set it (export NCCL_SOCKET_IFNAME=hsn0, before mpiexec, which passes the whole
# environment on) only if NCCL_DEBUG=INFO shows the bootstrap on an interface other nodes cannot reach and the first
# collective hangs; `ip -br addr` on a compute node lists the candidates.
# The trainer reads its rank from PALS (PALS_RANKID, PALS_LOCAL_RANKID, PMI_SIZE, PALS_LOCAL_SIZE) and rank 0
# sends its host and a free port to the others with mpi4py.
mpiexec -n $((NNODES * GPUS_PER_NODE)) --ppn "$GPUS_PER_NODE" --depth 8 --cpu-bind depth --hostfile "$PBS_NODEFILE" \
  python -m tutorial.train_ddp --preset "${PRESET:-workshop}" --data-dir "${DATA_DIR:-data}" \
  --out "${OUT:-runs/ddp-${PBS_JOBID:-manual}}"
# torchrun instead, one per node (it starts the 4 ranks and numbers them; no MPI needed in the trainer):
#   mpiexec -n "$NNODES" --ppn 1 --depth 32 --cpu-bind depth torchrun --nnodes "$NNODES" --nproc_per_node 4 \
#     --rdzv_backend c10d --rdzv_endpoint "$(head -n 1 "$PBS_NODEFILE"):29500" --rdzv_id "$PBS_JOBID" \
#     -m tutorial.train_ddp --preset workshop
