"""What only the notebooks need, one module per notebook: demonstrations, measurements, plots and checks.
May import everything else in the package; nothing imports it."""
