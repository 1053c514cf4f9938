"""``single``: one process, no communication. The baseline every strategy must equal."""
from __future__ import annotations

from ..errors import UsageError
from .base import ReplicatedStrategy


class Single(ReplicatedStrategy):
    name = "single"

    @classmethod
    def validate(cls, cfg, world):
        if world != 1:
            raise UsageError(f"strategy 'single' runs one process; drop --workers {world} "
                             "or pick a parallel strategy")

    def synchronize(self):
        pass  # nothing to agree on with one replica
