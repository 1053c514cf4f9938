"""Pipeline parallelism: schedules as data (``schedules``), one executor (``executor``), the strategy."""
from .strategy import Pipeline

__all__ = ["Pipeline"]
