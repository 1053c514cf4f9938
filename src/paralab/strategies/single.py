"""``single``: one process, no communication. The baseline every strategy must equal."""
from __future__ import annotations

from ..errors import UsageError
from .data_parallel import DataParallel


class Single(DataParallel):
    name = "single"
    roles = ("baseline",)
    # replicas_cls: the base Replicas, one replica with nothing to agree on

    @classmethod
    def validate(cls, cfg, world):
        if world != 1:
            raise UsageError(f"strategy 'single' runs one process; drop --workers {world} "
                             "or pick a parallel strategy")

    @classmethod
    def pipeline_replicas(cls, cfg):
        return None  # one process: there is no pipeline to compose with
