"""``--check``: the single-process reference (``reference.py``) and the verdict every rank agrees
on (``verdict.py``)."""
