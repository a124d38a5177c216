"""`tutorial check-ddp SCRIPT [-- ARGS]`: run your own DDP training script under torchrun, unchanged, and say what is
wrong with it, from what its ranks did.

    tutorial check-ddp train.py -- --epochs 2            # 2 ranks; the CPU (gloo) unless there is a GPU per rank
    tutorial check-ddp train.py --nproc 4 --max-seconds 300 --max-steps 500 --out /tmp/check

Each rank runs under tutorial.checkddp.recorder, which watches the calls the script makes (process group,
samplers, loaders, DDP, optimizer steps, saves, prints) without changing them. From the ranks' reports come the
findings, one line each: what is wrong, the fix, and the script's line where there is one. Exit 0: nothing wrong
(warnings are printed), 1: findings, 2: bad input. The script runs in a scratch folder (--out, else a new temporary
one, named in the report), so its relative writes land there; nothing else of yours is touched, and every process
the check started is stopped before it returns. Notebook 03b's "bring your own script" runs it.

The room, one way: command (the command line) -> run (scratch folder, torchrun, watching; the only module that starts
processes) -> findings (pure functions of the ranks' reports) and recorder (inside each rank) -> patchers (one
function per recorded API). From Python (a notebook): `from tutorial.checkddp.run import check_ddp`.
"""
