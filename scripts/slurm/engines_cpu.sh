#!/bin/bash
# engines.sh for nodes without GPUs (the virtual cluster of scripts/virtual_cluster.sh): one engine per task, ppn per
# node. A batch template for ipyparallel's SlurmEngineSetLauncher, filled in and submitted by tutorial.launch.engines,
# from a Python process on the first node (the controller must listen where the engines can reach it):
#
#   cluster = tutorial.launch.engines.start(
#       n=2, engines="slurm", interface="eth0", device="cpu",
#       launcher=dict(batch_template_file="scripts/slurm/engines_cpu.sh", queue="debug",
#                     namespace=dict(timelimit="00:10:00", ppn=1)))
#
# {n}, {queue}, {cluster_id}, {output_file} and {program_and_args} come from ipyparallel; timelimit and ppn (engines
# per node) from `namespace`.
#SBATCH --job-name=ipengine-{cluster_id}
#SBATCH --partition={queue}
#SBATCH --time={timelimit}
#SBATCH --nodes={(n + ppn - 1) // ppn}
#SBATCH --ntasks={n}
#SBATCH --ntasks-per-node={ppn}
#SBATCH --cpus-per-task=1
#SBATCH --output={output_file}
#SBATCH --export=ALL
# Slurm >= 22.05: srun no longer inherits --cpus-per-task from sbatch; without this every task gets one core.
export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
srun --kill-on-bad-exit=1 {program_and_args}
