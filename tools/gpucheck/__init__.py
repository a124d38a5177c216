"""`make gpu-check`: the GPU path of the workbook verified in stages of at most 8 minutes each, on any machine with a
CUDA GPU, including an offline compute node that has only its own Python and torch (scripts/gpu_check.sh brings the
rest as wheels). Which checks, in which stage, with the seconds each is estimated to take on one H100: `--list`.

Every check is a real run, as an attendee or instructor would start it (python -m, torchrun, horovodrun, a notebook
executed top to bottom), and it passes only if its claims hold, not on its exit code alone: the run's metrics.json
shows the device it was meant to use, the number of ranks it was started with, identical replicas (every rank's
parameter checksum), a finite training loss that falls from the first epoch to the last, the throughput, and the
preset's accuracy bound where the check trains long enough to have one (the notebooks assert theirs). Each check has
its own time limit, after which its whole process group and every process it started are killed; each outcome is one
JSON line appended to DIR/gpu_check.jsonl as it ends, with the hardware, versions and date (bench/record.py). A
missing program or package is a recorded skip with the reason; a check the stage's time budget cannot fit is a
recorded skip too. The executed notebook (or the log) of a failed check is kept in DIR.

    python -m gpucheck --stage 1 --results-dir DIR [--list] [--gpus N] [--only NAME,...]

plan.py: the checks as data; verify.py: whether a run shows its claims (pure); runner.py: running a stage, the probe
and the notebook executor; __main__.py: the command line. A tool of the repository's: nothing in the package imports
it.
"""
