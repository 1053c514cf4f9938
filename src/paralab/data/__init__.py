"""Data: in-memory datasets, DistributedSampler-style sharding, batched transforms."""
from .datasets import DATASETS, Dataset, check_dataset, load_dataset, resolve_dataset
from .loader import BatchSource
from .sharding import shard_indices, steps_per_epoch

__all__ = ["DATASETS", "Dataset", "BatchSource", "check_dataset", "load_dataset",
           "resolve_dataset", "shard_indices", "steps_per_epoch"]
