"""What every trainer imports: config, data, models, optim, precision, checkpoint, tracking, distributed, process.

Nothing here imports the launch layer, the benchmarks or the lessons (tests/test_design.py checks it)."""
