#!/bin/bash -l
# ipyparallel engines on Polaris (ALCF): PBS Pro, 4 A100 per node, Cray MPICH's mpiexec (PALS); one engine per GPU.
# A batch template for ipyparallel's PBSEngineSetLauncher, which tutorial.launch.engines fills in and submits:
#
#   cluster = tutorial.launch.engines.start(
#       n=8, engines="pbs",                # the controller listens on every interface of the notebook's node
#       launcher=dict(batch_template_file="scripts/pbs/polaris/engines.sh", queue="debug",
#                     namespace=dict(account="MyProject", walltime="01:00:00", ppn=4)),
#       timeout=1800)                      # the job may wait in the queue
#
# ipyparallel fills in n, queue, cluster_id, output_file and program_and_args; `namespace` gives account, walltime
# and ppn (engines per node: 4, one per GPU). Every brace pair below is a placeholder, so the shell code uses $NAME.
#PBS -N ipengine-{cluster_id}
#PBS -A {account}
#PBS -q {queue}
#PBS -l select={(n + ppn - 1) // ppn}:system=polaris
#PBS -l place=scatter
#PBS -l walltime={walltime}
#PBS -l filesystems=home:eagle
#PBS -j oe
#PBS -o {output_file}
#PBS -V
# -V: the job gets the environment qsub ran in (the notebook's PATH, its venv, the cluster id), and mpiexec passes it
# on to every engine.
cd "$PBS_O_WORKDIR"
# As in ddp.sh: local rank i on cores 8i..8i+7 and GPU 3-i, the one nearest them (tutorial.launch.engines gives
# local rank i visible GPU i). A CUDA_VISIBLE_DEVICES the notebook chose (start(gpus=...)) is kept.
printenv CUDA_VISIBLE_DEVICES >/dev/null || export CUDA_VISIBLE_DEVICES=3,2,1,0
# --mpi: each engine joins MPI, so its MPI rank becomes its rank (Horovod needs that).
mpiexec -n {n} --ppn {ppn} --depth 8 --cpu-bind depth --hostfile "$PBS_NODEFILE" {program_and_args} --mpi
