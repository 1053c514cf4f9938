"""paralab: a parallel-training lab on torch.distributed."""
__version__ = "0.1.0"
