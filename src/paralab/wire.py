"""What ranks send each other besides tensors: JSON and raw tensor bytes, never a pickle.

``torch.distributed``'s object collectives pickle what they send and unpickle
what they receive, and unpickling runs whatever code the bytes name: anyone
who reaches a rank's port could run code there. paralab's ranks exchange
small structures (records, verdicts, a partition, a state to compare) made of
dicts, lists, tuples, strings, numbers, booleans, None and CPU tensors, and
:func:`encode` writes exactly those: a JSON document of the structure, each
tensor replaced by its dtype, shape and place in the raw bytes that follow.
:func:`decode` reads them back and can build nothing else: a crafted message
can at most be refused (``ValueError``), never run.

Layout: 8 bytes, the JSON's length (little-endian); the JSON (UTF-8); the
tensors' bytes, one after the other. In the JSON a dict is
``{"d": [[key, value], ...]}`` (its keys keep their types: ints, strings,
tuples), a list ``{"l": [...]}``, a tuple ``{"u": [...]}``, a tensor ``{"t":
[dtype, shape, offset, bytes]}``; strings, numbers, booleans and null are
themselves.
"""
from __future__ import annotations

import json
import math

import torch

#: the tensor dtypes a message may hold, by name
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}
HEADER = 8


def encode(obj) -> bytes:
    """``obj`` (dicts, lists, tuples, str, int, float, bool, None, tensors) as bytes; TypeError otherwise."""
    chunks: list[bytes] = []
    at = 0

    def tree(x):
        nonlocal at
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return x if math.isfinite(x) else {"f": repr(x)}  # nan, inf: not JSON numbers
        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu").contiguous()
            name = str(t.dtype).removeprefix("torch.")
            if name not in DTYPES:
                raise TypeError(f"wire: tensors of {t.dtype} are not sent")
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            chunks.append(raw)
            at += len(raw)
            return {"t": [name, list(t.shape), at - len(raw), len(raw)]}
        if isinstance(x, dict):
            return {"d": [[tree(k), tree(v)] for k, v in x.items()]}
        if isinstance(x, list):
            return {"l": [tree(v) for v in x]}
        if isinstance(x, tuple):
            return {"u": [tree(v) for v in x]}
        raise TypeError(f"wire: a {type(x).__name__} is not sent (dicts, lists, tuples, str, numbers, bool, "
                        "None and tensors are)")

    text = json.dumps(tree(obj), separators=(",", ":")).encode()
    return len(text).to_bytes(HEADER, "little") + text + b"".join(chunks)


def decode(data: bytes):
    """The inverse of :func:`encode`; ValueError for anything that is not such a message."""
    data = bytes(data)
    if len(data) < HEADER:
        raise ValueError("wire: a message shorter than its header")
    size = int.from_bytes(data[:HEADER], "little")
    if size > len(data) - HEADER:
        raise ValueError("wire: the message is shorter than its structure says")
    try:
        doc = json.loads(data[HEADER:HEADER + size].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"wire: the structure is not JSON ({exc})") from None
    payload = memoryview(data)[HEADER + size:]

    def tree(x):
        if x is None or isinstance(x, (bool, str, int, float)):
            return x
        if isinstance(x, dict) and len(x) == 1:
            (kind, body), = x.items()
            if kind == "f" and body in ("nan", "inf", "-inf"):
                return float(body)
            if kind == "l" and isinstance(body, list):
                return [tree(v) for v in body]
            if kind == "u" and isinstance(body, list):
                return tuple(tree(v) for v in body)
            if kind == "d" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
                return {_key(tree(k)): tree(v) for k, v in body}
            if kind == "t":
                return _tensor(body, payload)
        raise ValueError(f"wire: {json.dumps(x)[:80]} is not part of a message")

    return tree(doc)


def _key(k):
    if isinstance(k, (list, dict)):
        raise ValueError("wire: a dict key must be a string, a number, a tuple or null")
    return k


def _tensor(body, payload: memoryview) -> torch.Tensor:
    if not (isinstance(body, list) and len(body) == 4 and body[0] in DTYPES and isinstance(body[1], list)
            and all(isinstance(n, int) and n >= 0 for n in body[1]) and isinstance(body[2], int)
            and isinstance(body[3], int)):
        raise ValueError(f"wire: {str(body)[:80]} does not describe a tensor")
    name, shape, offset, nbytes = body
    dtype = DTYPES[name]
    numel = math.prod(shape)
    if nbytes != numel * torch.empty(0, dtype=dtype).element_size() or not 0 <= offset <= len(payload) - nbytes:
        raise ValueError(f"wire: a {name} tensor of shape {shape} does not fit its {nbytes} bytes")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(payload[offset:offset + nbytes]), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
