#!/bin/bash
# ipyparallel engines on a PBS cluster whose MPI is Open MPI (ThetaGPU-like: 8 A100 per node); one engine per GPU.
# A batch template for ipyparallel's PBSEngineSetLauncher, which tutorial.launch.engines fills in and submits:
#
#   cluster = tutorial.launch.engines.start(
#       n=16, engines="pbs",               # the controller listens on every interface of the notebook's node
#       launcher=dict(batch_template_file="scripts/pbs/openmpi/engines.sh", queue="gpu",
#                     namespace=dict(account="MyProject", walltime="01:00:00", ppn=8)),
#       timeout=1800)                      # the job may wait in the queue
#
# ipyparallel fills in n, queue, cluster_id, output_file and program_and_args; `namespace` gives account, walltime
# and ppn (engines per node = GPUs per node). Every brace pair below is a placeholder, so the shell code uses $NAME.
#PBS -N ipengine-{cluster_id}
#PBS -A {account}
#PBS -q {queue}
#PBS -l select={(n + ppn - 1) // ppn}:ngpus={ppn}:mpiprocs={ppn}
#PBS -l place=scatter:excl
#PBS -l walltime={walltime}
#PBS -j oe
#PBS -o {output_file}
#PBS -V
# -V: the job gets the environment qsub ran in (the notebook's PATH, its venv, the cluster id). Open MPI passes on to
# the engines of other nodes only the variables named with -x: those below that are set.
cd "$PBS_O_WORKDIR"
exports=""
for name in PATH LD_LIBRARY_PATH VIRTUAL_ENV PYTHONPATH PYTHONUNBUFFERED IPP_CLUSTER_ID IPP_PROFILE_DIR \
            TUTORIAL_LAUNCH CUDA_VISIBLE_DEVICES NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME; do
  if printenv "$name" >/dev/null; then exports="$exports -x $name"; fi
done
# --mpi: each engine joins MPI, so its MPI rank becomes its rank (Horovod needs that); tutorial.launch.engines gives
# local rank i GPU i of its node.
mpirun -np {n} -npernode {ppn} -hostfile "$PBS_NODEFILE" -bind-to none $exports {program_and_args} --mpi
