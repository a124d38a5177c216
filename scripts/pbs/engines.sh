#!/bin/bash
# ipyparallel engines on a ThetaGPU-like PBS system (8 GPUs per node, Cray PALS or Open MPI mpiexec), one per GPU.
# A batch template for ipyparallel's PBSEngineSetLauncher, filled in and submitted by tutorial.launch.engines (06_multi_node):
#
#   cluster = tutorial.launch.engines.start(
#       n=16, engines="pbs", interface="hsn0",          # the controller listens where compute nodes can reach it
#       launcher=dict(batch_template_file="scripts/pbs/engines.sh", queue="debug",
#                     namespace=dict(account="MyProject", walltime="01:00:00", ppn=8)),
#       timeout=1800)                                     # the job may wait in the queue
#
# {n}, {queue}, {cluster_id}, {output_file} and {program_and_args} come from ipyparallel; account, walltime and ppn
# (engines per node = GPUs per node) from `namespace`. The engines run under mpiexec with --mpi, so the MPI rank is
# the rank (Horovod needs that), and tutorial.launch.engines pins GPU local_rank on each node.
#PBS -N ipengine-{cluster_id}
#PBS -A {account}
#PBS -q {queue}
#PBS -l select={(n + ppn - 1) // ppn}:ngpus={ppn}
#PBS -l walltime={walltime}
#PBS -l filesystems=home
#PBS -j oe
#PBS -o {output_file}
#PBS -V
# -V: the job gets the notebook's environment: the virtual environment's PATH, the cluster id and the
# controller's address.
cd "$PBS_O_WORKDIR"
# One engine per GPU: ppn ranks per node, each bound to its share of the node's cores.
mpiexec -n {n} --ppn {ppn} --depth $(( $(nproc) / {ppn} )) --cpu-bind depth {program_and_args} --mpi
