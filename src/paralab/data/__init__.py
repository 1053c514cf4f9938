"""Data: in-memory datasets (images; byte-level texts), DistributedSampler-style sharding, batched transforms."""
from dataclasses import dataclass

from ..options import option
from .datasets import DATASETS, Dataset, check_dataset, load_dataset, resolve_dataset, train_size
from .loader import BatchSource, to_device
from .sharding import padded_samples, shard_indices, steps_per_epoch
from .text import TEXT_DATASETS, TextDataset


@dataclass
class DataOptions:
    """data"""
    dataset: str = option("auto", "the training data: auto (the first present for the model, else synthetic), "
                                  "an image set, or for --model gpt a text of byte tokens; `paralab data info` "
                                  "lists them", choices=DATASETS, noun="dataset")
    data_dir: str | None = option(None, "folder with the dataset files", type=str)
    synthetic_size: int = option(10000, "synthetic training samples (synthetic-text: training windows)",
                                 positive=True)
    packing: bool = option(False, "a dataset of documents (synthetic-docs, jargon-entries) packed one after another "
                                  "into full windows, attention kept inside each document; else one document per "
                                  "window, padded (docs/data.md#documents)", identity=True)
    doc_length: int = option(64, "synthetic-docs: the median document length in bytes (log-normal, sigma 1)",
                             positive=True, identity=True)
    augment: bool = option(True, "random crop (pad 4) and horizontal flip of the training images")
    drop_last: bool = option(False, "epochs of n // B full global batches: the n mod B samples left over (other "
                                    "ones each epoch) are skipped instead of padding the last batch with "
                                    "repeated samples; then every replica count, single included, trains the "
                                    "same batches")


__all__ = ["DATASETS", "DataOptions", "Dataset", "BatchSource", "check_dataset", "load_dataset",
           "padded_samples", "resolve_dataset", "shard_indices", "steps_per_epoch", "train_size",
           "TEXT_DATASETS", "TextDataset", "to_device"]
