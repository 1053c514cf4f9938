"""The cost model and run analysis.

- ``memory``: bytes per worker for DDP and ZeRO stages 1/2/3;
- ``cost``: all-reduce and gather/scatter time, pipeline bubble, boundary traffic, bandwidth utilisation;
- ``scaling``: speedup, efficiency, weak/strong scaling, compute vs communication per worker count;
- ``timeline``: what the spans say, derived from records only (warm-up, overlap, bubble, microbatches alive);
- ``runs``: reading run directories (the only input plots and reports use).
"""
