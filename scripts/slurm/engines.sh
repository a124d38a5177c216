#!/bin/bash
# ipyparallel engines on a Slurm cluster with GPU nodes, one engine per GPU.
# A batch template for ipyparallel's SlurmEngineSetLauncher, filled in and submitted by tutorial.launch.engines
# (06_multi_node):
#
#   cluster = tutorial.launch.engines.start(
#       n=8, engines="slurm", interface="ib0",            # the controller listens where compute nodes can reach it
#       launcher=dict(batch_template_file="scripts/slurm/engines.sh", queue="gpu",
#                     namespace=dict(account="my_account", timelimit="01:00:00", ppn=4, cpus_per_gpu=8)),
#       timeout=1800)                                      # the job may wait in the queue
#
# {n}, {queue}, {cluster_id}, {output_file} and {program_and_args} come from ipyparallel; account, timelimit, ppn
# (engines per node = GPUs per node) and cpus_per_gpu from `namespace`. srun starts the engines; tutorial.launch.engines
# numbers them node by node and pins GPU local_rank on each node (every engine sees all of its node's GPUs).
#SBATCH --job-name=ipengine-{cluster_id}
#SBATCH --partition={queue}
#SBATCH --account={account}
#SBATCH --time={timelimit}
#SBATCH --nodes={(n + ppn - 1) // ppn}
#SBATCH --ntasks={n}
#SBATCH --ntasks-per-node={ppn}
#SBATCH --gpus-per-node={ppn}
#SBATCH --cpus-per-task={cpus_per_gpu}
#SBATCH --output={output_file}
#SBATCH --export=ALL
# --export=ALL: the job gets the notebook's environment: the virtual environment's PATH, the cluster id and the
# controller's address.
# Slurm >= 22.05: srun no longer inherits --cpus-per-task from sbatch; without this every task gets one core.
export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
# --kill-on-bad-exit: one engine that dies takes the others down, rather than leaving a job that never finishes.
srun --kill-on-bad-exit=1 --cpu-bind=cores {program_and_args}
