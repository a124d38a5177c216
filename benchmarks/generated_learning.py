"""How well the workshop preset learns the made-up images (core.data.GeneratedImages) that stand in for CIFAR-10
where nothing can be downloaded (CI, an offline GPU node): the test accuracy after each epoch, for a few pattern
sizes and contrasts, so the accuracy that notebooks 01 and 03b assert (lessons.notebook.EXPECTED_ACCURACY) is one a
working run reaches with room, and a broken one does not. One JSON line per setting in results/generated_learning.jsonl.

    python benchmarks/generated_learning.py                          # the defaults, on this machine's GPU
    python benchmarks/generated_learning.py --setting 8:0.6 --setting 1:0.6 --precision fp16
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from tutorial import train_single  # noqa: E402
from tutorial.bench.record import append_result  # noqa: E402
from tutorial.core.config import TrainConfig  # noqa: E402
from tutorial.core.data import GeneratedImages  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", action="append", default=None, metavar="CELL:CONTRAST",
                    help="pattern cell in pixels (1: one random value per pixel) and the pattern's share of each "
                         "pixel; repeatable (default: the dataset's own)")
    ap.add_argument("--preset", default="workshop")
    ap.add_argument("--generated", type=int, default=5000, help="training images (a quarter as many to test)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--precision", default=None)
    ap.add_argument("--results-dir", default="results")
    args = ap.parse_args(argv)
    settings = args.setting or [f"{GeneratedImages.CELL}:{GeneratedImages.CONTRAST}"]
    for setting in settings:
        try:
            cell, contrast = int(setting.split(":")[0]), float(setting.split(":")[1])
        except (IndexError, ValueError):
            print(f"generated_learning: --setting {setting!r} is not CELL:CONTRAST (e.g. 8:0.6)", file=sys.stderr)
            return 2
        # loader workers fork after this, so they make the same images
        GeneratedImages.CELL, GeneratedImages.CONTRAST = cell, contrast
        overrides = dict(generated=args.generated, epochs=args.epochs)
        if args.precision:
            overrides["precision"] = args.precision
        with tempfile.TemporaryDirectory() as out:
            cfg = TrainConfig.preset(args.preset, out=out, **overrides)
            metrics = train_single.main(cfg)
        curve = [round(e["test_accuracy"], 4) for e in metrics["epochs"]]
        path = append_result(args.results_dir, "generated_learning", sys.argv,
                             dict(preset=args.preset, cell=cell, contrast=contrast, generated=args.generated,
                                  epochs=args.epochs, precision=cfg.precision, device=metrics.get("device")),
                             dict(test_accuracy=curve, test_loss=[round(e["test_loss"], 4) for e in metrics["epochs"]],
                                  train_loss=[round(e["train_loss"], 4) for e in metrics["epochs"]]))
        print(f"cell {cell} contrast {contrast} {cfg.precision}: test accuracy by epoch {curve} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
