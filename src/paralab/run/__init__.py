"""One run: its options (``config.py``), how its ranks start and are watched (``launch.py``; the
rendezvous and core pinning in ``rendezvous.py``; who failed first and how to resume in
``failures.py``), one rank's life (``worker.py``), the run directory it writes (``records.py``),
checkpoints, the emulated network, and ``runner.py`` for running a run from a program."""
