"""Tensor parallelism: the tp dimension (``strategy.py``), its collectives (``ops.py``) and the
sharded forms of the gpt (``gpt.py``) and of the VGGs (``vgg.py``)."""
from .strategy import TensorOptions, TensorParallel, TensorParallelism

__all__ = ["TensorOptions", "TensorParallel", "TensorParallelism"]
