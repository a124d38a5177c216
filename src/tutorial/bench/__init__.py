"""Benchmarks for notebook 07_scaling_study: trainer throughput, all-reduce bandwidth, weak and strong scaling.

    tutorial bench train --strategy ddp --nproc 2 --preset smoke
    tutorial bench allreduce --backend gloo --nproc 2
    tutorial bench scaling --max-nproc 2

Every measurement is printed as a table and appended as one JSON line to results/<kind>.jsonl with the hardware,
the versions, the date and the exact command (record.py). Throughput: the real trainers run unchanged on synthetic
data of the real data's shape (`cfg.synthetic`) and time their own steps (`cfg.time_steps`, `core.tracking.RunLog`);
each repeat is a fresh set of processes from torch's elastic launcher (runs.py); the all-reduce is collectives.py. The studies are in studies.py,
the command line in cli.py.
"""
from .cli import main
from .collectives import allreduce_check, bus_bandwidth
from .record import append_result, environment, median_ci95, print_table, read_results, summary
from .runs import BenchError, RunFailed, available_processes, launch, launch_horovod, measure_run
from .studies import breakdown, nproc_ladder, scaling_table

__all__ = ["BenchError", "RunFailed", "allreduce_check", "append_result", "available_processes", "breakdown",
           "bus_bandwidth", "environment", "launch", "launch_horovod", "main", "measure_run", "median_ci95",
           "nproc_ladder", "print_table", "read_results", "scaling_table", "summary"]
