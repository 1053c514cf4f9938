"""Gradient compression, ``--compress fp16|bf16|powersgd``: the one package that knows it.

``--compress`` changes what a gradient bucket sends. Every method receives
the bucket after this rank's gradient, divided by N, was copied in (so the
sum over ranks is the mean), sends fewer bytes than the bucket's own, and
leaves the mean's estimate in the bucket.

- **fp16 / bf16**: the bucket is cast to the narrow type, all-reduced in it
  (half the bytes) and cast back; the sum itself runs in the narrow type.
- **powersgd**: low-rank compression with error feedback (:class:`PowerSGD`).

Who asks what:

- ``RunConfig.validate``: :func:`validate` (which strategies take
  ``--compress``: those that declare :class:`CompressOptions`; what cannot
  resume); ``ddp`` and ``torch-ddp``'s own ``validate``:
  :func:`validate_buckets`, :func:`validate_pytorch_hooks`;
- ``ddp`` (from primitives): :func:`make_compressor`, whose ``launch`` sends a
  bucket through ``comm.py`` (which records the bytes that really crossed);
- ``torch-ddp``: :func:`pytorch_comm_hook` (PyTorch's own ``ddp_comm_hooks``)
  and :func:`pytorch_hook_details`;
- ``--check``: :func:`reference_for`, the same arithmetic in one process;
- records and ``paralab compare``: :func:`run_label` (from a run's config
  dict), :func:`parse_variants` and the constants beside it.

The modules: ``methods.py`` (what exists, how it is spelled, who may use it),
``buckets.py`` (our ddp's path), ``pytorch_hooks.py`` (torch-ddp's),
``reference.py`` (``--check``), ``lowrank.py`` (PowerSGD's shared arithmetic).
"""
from __future__ import annotations

from .buckets import CastCompression, InFlight, NoCompression, PowerSGD, make_compressor
from .lowrank import compressible, initial_q, matrix_shape, orthonormalize_
from .methods import (COMPRESSIONS, MIN_COMPRESSION_RATE, POWERSGD_START, Q_SEED, VARIANT_FIELDS,
                      VARIANT_SPELLINGS, WIRE_DTYPES, CompressOptions, accepts, parse_variants, run_label, validate,
                      validate_buckets, validate_pytorch_hooks)
from .pytorch_hooks import bf16_mean_hook, one_bucket_at_a_time, pytorch_comm_hook, pytorch_hook_details
from .reference import ReferenceCompression, reference_for

__all__ = ["CastCompression", "InFlight", "NoCompression", "PowerSGD", "make_compressor", "compressible", "initial_q",
           "matrix_shape", "orthonormalize_", "COMPRESSIONS", "MIN_COMPRESSION_RATE", "POWERSGD_START",
           "Q_SEED", "VARIANT_FIELDS", "VARIANT_SPELLINGS", "WIRE_DTYPES", "CompressOptions", "accepts",
           "parse_variants", "run_label", "validate", "validate_buckets", "validate_pytorch_hooks", "bf16_mean_hook",
           "one_bucket_at_a_time", "pytorch_comm_hook", "pytorch_hook_details", "ReferenceCompression", "reference_for"]
