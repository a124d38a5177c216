#!/bin/bash
# Horovod on a ThetaGPU/Polaris-like PBS system (seed 002's qsub + mpirun recipe), one rank per GPU.
#   qsub -A <project> -q <queue> -l select=2:ngpus=8 -l walltime=00:30:00 scripts/pbs/horovod.sh
# Build Horovod with NCCL on the GPU node first: HOROVOD_GPU_OPERATIONS=NCCL make install
#PBS -N horovod
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-$(dirname "$0")/../..}"
source .venv/bin/activate
NODEFILE=${PBS_NODEFILE:-${COBALT_NODEFILE:?no PBS_NODEFILE or COBALT_NODEFILE: run this through qsub}}
NNODES=$(sort -u "$NODEFILE" | wc -l)
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
mpiexec -n $((NNODES * GPUS_PER_NODE)) --ppn "$GPUS_PER_NODE" --hostfile "$NODEFILE" \
  python -m tutorial.train_horovod --preset workshop --data-dir "${DATA_DIR:-data}" --out "runs/hvd-${PBS_JOBID:-manual}"
# With Open MPI instead of Cray MPICH:  mpirun -np N -npernode 8 -hostfile "$NODEFILE" -bind-to none -map-by slot \
#   -x NCCL_DEBUG=INFO -x LD_LIBRARY_PATH -x PATH python -m tutorial.train_horovod ...
# Or Horovod's launcher:  horovodrun -np N -H host1:8,host2:8 python -m tutorial.train_horovod ...
