"""Data: in-memory datasets (images; byte-level texts), DistributedSampler-style sharding, batched transforms."""
from .datasets import DATASETS, Dataset, check_dataset, load_dataset, resolve_dataset, train_size
from .loader import BatchSource, to_device
from .sharding import padded_samples, shard_indices, steps_per_epoch
from .text import TEXT_DATASETS, TextDataset

__all__ = ["DATASETS", "Dataset", "BatchSource", "check_dataset", "load_dataset",
           "padded_samples", "resolve_dataset", "shard_indices", "steps_per_epoch", "train_size",
           "TEXT_DATASETS", "TextDataset", "to_device"]
