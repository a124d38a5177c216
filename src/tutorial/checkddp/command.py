"""`tutorial check-ddp SCRIPT [options] [-- SCRIPT_ARGS...]`: the command line of tutorial.checkddp.run.check_ddp."""
from __future__ import annotations

import sys

from ..core.config import OneLineErrorParser
from .run import BadInput, check_ddp


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = OneLineErrorParser(
        prog="tutorial check-ddp", usage="tutorial check-ddp SCRIPT [options] [-- SCRIPT_ARGS...]",
        description="Run your DDP training script, unchanged, under torchrun and say what is wrong with it, from what "
                    "its ranks did. Exit 0: nothing wrong, 1: findings, 2: bad input.")
    parser.add_argument("script", help="your training script, run unchanged")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (default 2)")
    parser.add_argument("--max-seconds", type=float, default=120.0,
                        help="then every rank stops after the same step (default 120)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    parser.add_argument("--out", default=None, help="scratch folder for the run (default: a new temporary one)")
    parser.add_argument("--no-lr-check", action="store_true",
                        help="skip the one-process run that compares the learning rate")
    try:
        opts = parser.parse_args(own)
    except SystemExit as exc:
        return 0 if exc.code == 0 else 2
    try:
        report = check_ddp(opts.script, script_args, opts.nproc, opts.max_seconds, opts.max_steps, opts.out,
                           lr_check=not opts.no_lr_check)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.text())
    return report.exit_code
