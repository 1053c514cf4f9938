"""One run: its options (``config.py``), how its ranks start and are watched (``launch.py``), one
rank's life (``worker.py``), the run directory it writes (``records.py``), checkpoints, the
emulated network, and ``runner.py`` for running a run from a program."""
