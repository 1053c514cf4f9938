"""Pipeline parallelism: schedules as data (``actions``, ``builders``, ``schedules``, checked by
``simulate``), one executor (``executor``), the strategy."""
from .strategy import Pipeline

__all__ = ["Pipeline"]
