"""Context parallelism (``--cp``): layout.py (who holds which tokens), ring.py, ulysses.py, strategy.py."""
from .strategy import ContextOptions, ContextParallel, ContextParallelism

__all__ = ["ContextOptions", "ContextParallel", "ContextParallelism"]
