import gzip
import os
import pickle
import struct

import numpy as np
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from paralab.data import BatchSource, shard_indices
from paralab.data.datasets import (FASHION_FILES, load_cifar10, load_fashion_mnist, make_synthetic,
                                   read_cifar_batch, read_idx)
from paralab.data.sharding import epoch_permutation
from paralab.data.download import info
from paralab.data.transforms import PAD, augmentation_params, crop_flip, normalize
from paralab.errors import UsageError


@pytest.mark.parametrize("n,world", [(10, 1), (10, 3), (11, 4), (7, 2), (3, 5), (256, 2)])
@pytest.mark.parametrize("epoch", [0, 3])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sharding_matches_distributed_sampler(n, world, epoch, shuffle, drop_last):
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=7,
                                     drop_last=drop_last)
        sampler.set_epoch(epoch)
        ours = shard_indices(n, world, rank, seed=7, epoch=epoch, shuffle=shuffle, drop_last=drop_last)
        assert ours.tolist() == list(sampler)


def test_shards_of_a_step_form_the_global_batch():
    data = make_synthetic(train_size=200, test_size=40)
    single = BatchSource(data, per_rank_batch=32, replicas=1, seed=3)
    pair = [BatchSource(data, per_rank_batch=16, replicas=2, rank=r, seed=3) for r in range(2)]
    for step in (0, 4, 7):  # step 7 is in the second epoch
        _, whole = single.indices(step)
        parts = torch.cat([s.indices(step)[1] for s in pair])
        assert sorted(whole.tolist()) == sorted(parts.tolist())


def plain_synthetic_images(n, labels, templates, gen):
    """How synthetic images were made before they were made from a table of shifted templates: the
    class template gathered at shifted coordinates, plus noise (the result laid out channels-last)."""
    shift = torch.randint(-3, 4, (n, 2), generator=gen)
    noise = torch.randn(n, 3, 32, 32, generator=gen) * 40
    base = templates[labels]
    rows = (torch.arange(32).view(1, 32) - shift[:, :1]) % 32
    cols = (torch.arange(32).view(1, 32) - shift[:, 1:]) % 32
    idx = torch.arange(n).view(n, 1, 1)
    shifted = base[idx, :, rows.unsqueeze(2), cols.unsqueeze(1)].permute(0, 3, 1, 2)
    return (shifted + noise).clamp(0, 255).to(torch.uint8)


@pytest.mark.parametrize("train,test,seed", [(512, 1000, 0), (300, 50, 1)])
def test_synthetic_images_are_the_bytes_and_layout_they_always_were(monkeypatch, train, test, seed):
    from paralab.data import datasets
    fast = make_synthetic(train, test, seed=seed)
    monkeypatch.setattr(datasets, "shifted_templates", lambda templates: templates)
    monkeypatch.setattr(datasets, "synthetic_images", plain_synthetic_images)
    plain = make_synthetic(train, test, seed=seed)
    for a, b in ((fast.train_x, plain.train_x), (fast.test_x, plain.test_x)):
        assert torch.equal(a, b) and a.stride() == b.stride() == (3072, 1, 96, 3)
    assert torch.equal(fast.train_y, plain.train_y) and (fast.mean, fast.std) == (plain.mean, plain.std)


@pytest.mark.parametrize("train,test,seed", [(512, 1000, 0), (300, 50, 1)])
def test_the_kept_synthetic_set_is_the_generated_one(tmp_path, monkeypatch, train, test, seed):
    """A run loads the synthetic set through a kept copy (raw bytes, no pickle): generated the first time,
    read back after that, and either way the bytes, layout, labels and normalisation of
    ``make_synthetic``'s; a damaged copy is generated again, a cache that cannot be written only not kept."""
    from paralab.data import datasets as ds
    from paralab.data import decoded
    monkeypatch.setenv("PARALAB_DECODED", str(tmp_path / "copies"))
    made = make_synthetic(train, test, seed=seed)

    def same(d):
        for name in ("train_x", "train_y", "test_x", "test_y"):
            a, b = getattr(d, name), getattr(made, name)
            assert torch.equal(a, b) and a.stride() == b.stride() and a.dtype == b.dtype, name
        assert (d.mean, d.std, d.classes, d.source) == (made.mean, made.std, made.classes, made.source)
    same(ds.load_synthetic(train, test, seed))
    (kept,) = (tmp_path / "copies").iterdir()
    assert kept.read_bytes().startswith(decoded.MAGIC) and f"seed{seed}-{train}-{test}" in kept.name
    monkeypatch.setattr(ds, "make_synthetic", lambda *a, **k: pytest.fail("generated again"))
    read = ds.load_synthetic(train, test, seed)
    same(read)
    read.train_x[0, 0, 0, 0] += 1  # a writable tensor of its own, not a view of the file's bytes
    same(ds.load_synthetic(train, test, seed))
    monkeypatch.setattr(ds, "make_synthetic", make_synthetic)
    kept.write_bytes(kept.read_bytes()[:-5])  # cut short: generated again and replaced
    same(ds.load_synthetic(train, test, seed))
    assert decoded.decode(kept.read_bytes(), ["train_x", "train_y", "test_x", "test_y", "stats"]) is not None
    monkeypatch.setenv("PARALAB_DECODED", str(kept))  # a file, not a folder: nowhere to keep it
    same(ds.load_synthetic(train, test, seed))


def test_synthetic_is_deterministic_and_cifar_shaped():
    a, b = make_synthetic(300, 50, seed=1), make_synthetic(300, 50, seed=1)
    c = make_synthetic(300, 50, seed=2)
    assert a.train_x.shape == (300, 3, 32, 32) and a.train_x.dtype == torch.uint8
    assert a.test_x.shape == (50, 3, 32, 32) and a.train_y.dtype == torch.int64
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.train_y, b.train_y)
    assert not torch.equal(a.train_x, c.train_x)
    assert set(a.train_y.tolist()) == set(range(10))


def naive_crop_flip(img, oy, ox, flip):
    padded = torch.nn.functional.pad(img, (PAD, PAD, PAD, PAD))
    out = padded[:, oy:oy + 32, ox:ox + 32]
    return out.flip(-1) if flip else out


def test_batched_crop_flip_equals_per_sample():
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (8, 3, 32, 32), generator=gen, dtype=torch.uint8)
    offsets, flips = augmentation_params(8, seed=5, epoch=0)
    batched = crop_flip(images, offsets, flips)
    for i in range(8):
        expected = naive_crop_flip(images[i], int(offsets[i, 0]), int(offsets[i, 1]), bool(flips[i]))
        assert torch.equal(batched[i], expected)


def test_augmentation_is_deterministic_per_sample_and_epoch():
    data = make_synthetic(128, 20)
    src = BatchSource(data, per_rank_batch=16, seed=9)
    x1, y1 = src.batch(2)
    x2, y2 = BatchSource(data, per_rank_batch=16, seed=9).batch(2)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    # the same sample is augmented identically whichever rank or batch holds it
    _, idx = src.indices(2)
    other = BatchSource(data, per_rank_batch=8, replicas=2, rank=1, seed=9)
    _, idx_other = other.indices(2 * 8 // 8)
    common = set(idx.tolist()) & set(idx_other.tolist())
    off, flips = augmentation_params(128, 9, 0)
    for i in list(common)[:3]:
        ref = normalize(crop_flip(data.train_x[i:i + 1], off[i:i + 1], flips[i:i + 1]), data.mean, data.std)
        pos = idx.tolist().index(i)
        assert torch.equal(x1[pos:pos + 1], ref)
    # a new epoch draws new augmentations
    assert not torch.equal(augmentation_params(128, 9, 0)[0], augmentation_params(128, 9, 1)[0])
    no_aug = BatchSource(data, per_rank_batch=16, seed=9, augment=False).batch(2)[0]
    assert not torch.equal(no_aug, x1)


def test_normalize_uses_given_statistics():
    x = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    out = normalize(x, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    assert torch.allclose(out, torch.full_like(out, 2.0))


# ------------------------------------------------------------ real formats, small generated files
def write_cifar_batch(path, images, labels):
    # as the official files: labels are Python ints (numpy integers would pickle a numpy scalar global)
    with open(path, "wb") as f:
        pickle.dump({b"data": images.reshape(len(images), -1), b"labels": [int(v) for v in labels],
                     b"batch_label": b"test"}, f)


def make_cifar(tmp_path, n=6):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    expect = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        y = rng.integers(0, 10, n)
        write_cifar_batch(folder / name, x, y)
        expect[name] = (x, y)
    return folder, expect


def test_cifar_pickle_reader(tmp_path):
    _, expect = make_cifar(tmp_path)
    data = load_cifar10(tmp_path, check_sizes=False)
    assert data.train_x.shape == (30, 3, 32, 32) and data.test_x.shape == (6, 3, 32, 32)
    assert np.array_equal(data.train_x[:6].numpy(), expect["data_batch_1"][0])
    assert data.train_y[6:12].tolist() == list(expect["data_batch_2"][1])
    assert np.array_equal(data.test_x.numpy(), expect["test_batch"][0])


def test_cifar_size_check_refuses_truncated_files(tmp_path):
    make_cifar(tmp_path)
    with pytest.raises(UsageError, match="expected 31035704"):
        load_cifar10(tmp_path)


def write_idx(path, array):
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def make_fashion(folder, n=5):
    rng = np.random.default_rng(1)
    arrays = {"train_x": rng.integers(0, 256, (n, 28, 28)), "train_y": rng.integers(0, 10, n),
              "test_x": rng.integers(0, 256, (3, 28, 28)), "test_y": rng.integers(0, 10, 3)}
    for key, (name, _) in FASHION_FILES.items():
        write_idx(folder / name, arrays[key])
    return arrays


def test_fashion_idx_reader(tmp_path):
    arrays = make_fashion(tmp_path)
    assert np.array_equal(read_idx(tmp_path / FASHION_FILES["train_x"][0]), arrays["train_x"])
    data = load_fashion_mnist(tmp_path, check_md5=False)
    assert data.train_x.shape == (5, 3, 32, 32)
    # padded by 2 and the gray channel repeated three times
    assert torch.equal(data.train_x[0, 1, 2:30, 2:30], torch.from_numpy(arrays["train_x"][0].astype(np.uint8)))
    assert torch.equal(data.train_x[:, 0], data.train_x[:, 2])
    assert int(data.train_x[:, :, :2].sum()) == 0
    assert data.test_y.tolist() == list(arrays["test_y"])


def test_fashion_decoded_once_then_read_from_its_cache(tmp_path, monkeypatch):
    """The first load inflates the files and keeps raw bytes under a checked header (no pickle); the next
    reads them back without inflating; a changed source file, a damaged copy or an unchecked one is
    decoded again; a cache that cannot be written is only not kept."""
    import os

    import paralab.data.datasets as ds
    from paralab.data import decoded
    monkeypatch.setenv("PARALAB_DECODED", str(tmp_path / "copies"))
    src = tmp_path / "src"
    src.mkdir()
    arrays = make_fashion(src)
    first = load_fashion_mnist(src, check_md5=False)
    (kept,) = (tmp_path / "copies").iterdir()
    assert kept.read_bytes().startswith(decoded.MAGIC) and b"numpy" not in kept.read_bytes()
    monkeypatch.setattr(ds, "read_idx", lambda *a, **k: pytest.fail("inflated again"))
    again = load_fashion_mnist(src, check_md5=False)
    assert torch.equal(again.train_x, first.train_x) and torch.equal(again.test_y, first.test_y)
    monkeypatch.setattr(ds, "read_idx", read_idx)
    # the MD5s checked or not: another copy (an unchecked one never stands in for a checked load)
    with pytest.raises(UsageError, match="MD5"):
        load_fashion_mnist(src)
    # a damaged copy (cut short) is decoded again and replaced
    kept.write_bytes(kept.read_bytes()[:-7])
    assert torch.equal(load_fashion_mnist(src, check_md5=False).train_x, first.train_x)
    assert decoded.decode(kept.read_bytes(), list(FASHION_FILES)) is not None
    # a source file changed since: decoded again from it
    arrays["test_y"] = (arrays["test_y"] + 1) % 10
    write_idx(src / FASHION_FILES["test_y"][0], arrays["test_y"])
    os.utime(src / FASHION_FILES["test_y"][0], ns=(1, 1))
    assert load_fashion_mnist(src, check_md5=False).test_y.tolist() == list(arrays["test_y"])
    # nowhere to keep it: loads all the same
    monkeypatch.setenv("PARALAB_DECODED", str(src / FASHION_FILES["test_y"][0]))  # a file, not a folder
    assert load_fashion_mnist(src, check_md5=False).test_y.tolist() == list(arrays["test_y"])


def test_fashion_md5_mismatch_is_refused(tmp_path):
    make_fashion(tmp_path)
    with pytest.raises(UsageError, match="MD5"):
        load_fashion_mnist(tmp_path)


def test_idx_reader_refuses_truncated(tmp_path):
    path = tmp_path / "bad.gz"
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">BBBBI", 0, 0, 8, 1, 100) + b"\x01" * 10)
    with pytest.raises(UsageError, match="corrupt"):
        read_idx(path)


def test_data_info_lists_every_dataset(tmp_path):
    make_cifar(tmp_path)
    text = info(tmp_path)
    assert "cifar10        present" in text and "synthetic" in text and "auto picks: cifar10" in text


def test_test_shards_are_padded_to_equal_calls_and_cover_every_sample_once():
    data = make_synthetic(train_size=64, test_size=1001)
    seen = []
    shapes = []
    for rank in range(2):
        src = BatchSource(data, per_rank_batch=8, replicas=2, rank=rank)
        batches = list(src.test_batches(500))
        shapes.append([len(y) for _, y, _ in batches])
        for x, y, real in batches:
            seen += y[real].tolist()
    assert shapes[0] == shapes[1] == [500, 1]
    assert sorted(seen) == sorted(data.test_y.tolist())


def test_download_offline_says_what_to_do(tmp_path):
    from paralab.data.download import DownloadError, download_cifar10
    from paralab.run.rendezvous import free_port
    url = f"http://127.0.0.1:{free_port()}/cifar-10-python.tar.gz"  # nothing listens there
    with pytest.raises(DownloadError, match="offline.*fashion-mnist"):
        download_cifar10(tmp_path, url=url, timeout=5, log=lambda *a: None)
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind


def test_download_rejects_a_bad_archive(tmp_path):
    import http.server
    import threading

    from paralab.data.download import DownloadError, download_cifar10
    served = tmp_path / "serve"
    served.mkdir()
    (served / "cifar-10-python.tar.gz").write_bytes(b"not the archive")
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(served), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        target = tmp_path / "data"
        with pytest.raises(DownloadError, match="MD5"):
            download_cifar10(target, url=f"http://127.0.0.1:{server.server_port}/cifar-10-python.tar.gz",
                             timeout=5, log=lambda *a: None)
        assert list(target.iterdir()) == []
    finally:
        server.shutdown()


def test_eval_bound_is_on_the_total_whatever_the_ranks():
    data = make_synthetic(train_size=64, test_size=300)
    for replicas in (1, 2, 3):
        real = sum(int(r.sum()) for rank in range(replicas)
                   for _, _, r in BatchSource(data, per_rank_batch=8, replicas=replicas, rank=rank)
                   .test_batches(50, max_batches=2))
        assert real == 100


# ------------------------------------------------------------ CIFAR-10 pickles: only what the official files hold
def op_global(module, name):  # GLOBAL: how Python 2's cPickle names a class or function
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def py2_str(raw):  # SHORT_BINSTRING / BINSTRING: a Python 2 str (bytes under encoding="bytes")
    return (b"U" + bytes([len(raw)]) if len(raw) < 256 else b"T" + struct.pack("<i", len(raw))) + raw


def py2_int(v):  # BININT1 / BININT2
    return b"K" + bytes([v]) if v < 256 else b"M" + struct.pack("<H", v)


def py2_cifar_batch(images, labels, reconstruct="numpy.core.multiarray"):
    """A batch as Python 2's cPickle (protocol 2) wrote the official files: a dict of str keys
    to a str, a list of ints, a numpy uint8 array [N, 3072] and a list of str; the array as
    numpy pickles one: ``_reconstruct(ndarray, (0,), "b")`` then ``__setstate__((1, shape,
    dtype("u1", 0, 1) with its state, False, raw bytes))``. Hand-assembled: Python 3 cannot
    write Python 2 strings."""
    n = len(images)
    dtype = (op_global("numpy", "dtype") + py2_str(b"u1") + b"K\x00K\x01\x87R"  # dtype("u1", 0, 1)
             + b"(K\x03" + py2_str(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb")
    array = (op_global(reconstruct, "_reconstruct") + op_global("numpy", "ndarray") + b"K\x00\x85"
             + py2_str(b"b") + b"\x87R"  # _reconstruct(ndarray, (0,), "b")
             + b"(K\x01" + py2_int(n) + py2_int(3072) + b"\x86" + dtype + b"\x89"
             + py2_str(images.reshape(n, -1).tobytes()) + b"tb")  # __setstate__((1, (n, 3072), dtype, False, raw))
    items = [(b"batch_label", py2_str(b"training batch 1 of 5")),
             (b"labels", b"](" + b"".join(py2_int(int(v)) for v in labels) + b"e"),
             (b"data", array),
             (b"filenames", b"](" + b"".join(py2_str(b"img_%d.png" % i) for i in range(n)) + b"e")]
    return b"\x80\x02}(" + b"".join(py2_str(k) + v for k, v in items) + b"u."


@pytest.mark.parametrize("reconstruct", ["numpy.core.multiarray", "numpy._core.multiarray"])
def test_cifar_reader_reads_the_official_python2_format(tmp_path, reconstruct):
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (7, 3, 32, 32), dtype=np.uint8)
    y = rng.integers(0, 10, 7)
    path = tmp_path / "data_batch_1"
    path.write_bytes(py2_cifar_batch(x, y, reconstruct))
    with open(path, "rb") as f:  # the unrestricted reader agrees: the hand-made file is a real batch
        plain = pickle.load(f, encoding="bytes")
    assert np.array_equal(plain[b"data"].reshape(-1, 3, 32, 32), x) and plain[b"labels"] == list(y)
    data, labels = read_cifar_batch(path)
    assert np.array_equal(data, x) and labels.tolist() == list(y) and labels.dtype == np.int64


class Payload:
    """What a crafted batch carries: unpickling it would create ``marker``."""

    def __init__(self, how, marker):
        self.how, self.marker = how, str(marker)

    def __reduce__(self):
        if self.how == "open":
            return open, (self.marker, "w")
        if self.how == "system":
            return os.system, (f"touch {self.marker}",)
        return eval, (f"open({self.marker!r}, 'w')",)


@pytest.mark.parametrize("how", ["open", "system", "eval"])
@pytest.mark.parametrize("where", ["top", "inside"])
def test_cifar_reader_refuses_code_without_running_it(tmp_path, how, where):
    marker = tmp_path / "pwned"
    x = np.zeros((2, 3072), dtype=np.uint8)
    obj = Payload(how, marker) if where == "top" else {b"data": x, b"labels": [1, 2], b"batch_label": Payload(how, marker)}
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps(obj))
    with pytest.raises(UsageError, match="no CIFAR-10 batch contains.*refused") as exc:
        read_cifar_batch(path)
    assert "data_batch_1" in str(exc.value)
    assert not marker.exists()


def test_cifar_reader_guards_the_numpy_names_it_allows(tmp_path):
    def refused(raw, match):
        path = tmp_path / "batch"
        path.write_bytes(raw)
        with pytest.raises(UsageError, match=match):
            read_cifar_batch(path)

    recon = op_global("numpy._core.multiarray", "_reconstruct")
    # ndarray itself is a token: calling it (or constructing it) fails
    refused(b"\x80\x02" + op_global("numpy", "ndarray") + b"K\x01\x85R.", "not callable")
    refused(b"\x80\x02" + op_global("numpy", "ndarray") + b")\x81.", "NEWOBJ")
    # _reconstruct only for a plain empty ndarray, dtype only without Python objects
    refused(b"\x80\x02" + recon + op_global("numpy", "dtype") + b"K\x00\x85U\x01b\x87R.", "empty plain ndarray")
    refused(b"\x80\x02" + recon + op_global("numpy", "ndarray") + b"M\x00\x10\x85U\x01b\x87R.", "empty plain ndarray")
    refused(b"\x80\x02" + op_global("numpy", "dtype") + b"U\x01O\x85R.", "Python objects")
    # other numpy names are as refused as any other global
    for module, name in (("numpy", "load"), ("numpy.core.multiarray", "scalar"), ("numpy", "frombuffer")):
        refused(b"\x80\x02" + op_global(module, name) + b".", f"{module}.{name}, which no CIFAR-10")
    # well-formed pickles that are not batches
    refused(pickle.dumps([1, 2, 3]), "holds a list")
    refused(pickle.dumps({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}), "uint8")
    refused(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 11]}), "0-9")


# ------------------------------------------------------------ uneven data: padding and --drop-last
@pytest.mark.parametrize("n,world,per_rank", [(201, 2, 20), (205, 2, 20), (100, 3, 7), (64, 4, 16), (11, 3, 1)])
def test_drop_last_trains_full_batches_and_never_repeats(n, world, per_rank):
    data = make_synthetic(train_size=n, test_size=10)
    batch = world * per_rank
    ranks = [BatchSource(data, per_rank_batch=per_rank, replicas=world, rank=r, seed=5, drop_last=True)
             for r in range(world)]
    single = BatchSource(data, per_rank_batch=batch, seed=5, drop_last=True)
    steps = n // batch  # as documented: n // B full global batches per epoch
    assert ranks[0].steps_per_epoch == single.steps_per_epoch == steps
    for epoch in (0, 1):
        order = epoch_permutation(n, 5, epoch)
        seen = []
        for i in range(steps):
            parts = [src.indices(epoch * steps + i) for src in ranks]
            assert all(e == epoch and len(idx) == per_rank for e, idx in parts)
            together = torch.cat([idx for _, idx in parts]).tolist()
            # the same samples as a single process with --drop-last: positions [iB, (i+1)B) of the epoch's order
            assert sorted(together) == sorted(single.indices(epoch * steps + i)[1].tolist())
            assert sorted(together) == sorted(order[i * batch:(i + 1) * batch].tolist())
            seen += together
        assert len(seen) == len(set(seen)) == steps * batch  # no sample repeats
    assert ranks[0].padding == 0 and ranks[0].repeated_samples(0, 10 * steps) == 0


@pytest.mark.parametrize("n,world,per_rank", [(205, 2, 20), (100, 3, 7), (37, 4, 4)])
def test_drop_last_is_distributed_sampler_and_data_loader_drop_last(n, world, per_rank):
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=3, drop_last=True)
        sampler.set_epoch(1)
        loader = list(torch.utils.data.DataLoader(range(n), batch_size=per_rank, sampler=sampler, drop_last=True))
        src = BatchSource(make_synthetic(train_size=n, test_size=10), per_rank_batch=per_rank, replicas=world,
                          rank=rank, seed=3, drop_last=True)
        assert src.steps_per_epoch == len(loader)
        for i, expected in enumerate(loader):
            assert src.indices(len(loader) + i)[1].tolist() == expected.tolist()  # epoch 1


def test_padding_repeats_samples_in_the_last_step_and_is_counted():
    n, world, per_rank = 205, 2, 20  # 205 = 5 * 40 + 5: six steps, the last padded by 1 sample
    data = make_synthetic(train_size=n, test_size=10)
    ranks = [BatchSource(data, per_rank_batch=per_rank, replicas=world, rank=r) for r in range(world)]
    assert ranks[0].steps_per_epoch == 6 and ranks[0].padding == 1
    seen = [torch.cat([src.indices(step)[1] for src in ranks]).tolist() for step in range(6)]
    assert [len(s) for s in seen] == [40] * 5 + [6]
    flat = sum(seen, [])
    assert len(flat) == n + 1 and len(set(flat)) == n  # every sample, one of them twice
    repeated = [i for i in set(flat) if flat.count(i) == 2]
    assert repeated == [int(epoch_permutation(n, 0, 0)[0])]  # the epoch's first sample ...
    assert repeated[0] in seen[5]  # ... again in the last step
    # counted over the steps a run trains: once per epoch-final step among them
    src = ranks[0]
    assert [src.repeated_samples(0, 5), src.repeated_samples(0, 6), src.repeated_samples(5, 7),
            src.repeated_samples(6, 11), src.repeated_samples(0, 18)] == [0, 1, 1, 0, 3]
    assert src.data_note(0, 5) is None
    note = src.data_note(0, 12)
    assert "205 training samples do not divide over 2" in note and "2 repeated sample(s)" in note
    assert "--drop-last" in note
    # nothing to say: one replica, or samples that divide
    assert BatchSource(data, per_rank_batch=40).data_note(0, 12) is None
    assert BatchSource(make_synthetic(train_size=204, test_size=10), per_rank_batch=20, replicas=2).data_note(0, 12) is None
    drop = BatchSource(data, per_rank_batch=per_rank, replicas=world, drop_last=True)
    assert "each epoch is 5 step(s) of 40" in drop.data_note(0, 5) and "last 5" in drop.data_note(0, 5)


def test_idx_reader_refuses_a_decompression_bomb(tmp_path, monkeypatch):
    monkeypatch.setattr("paralab.data.datasets.MAX_IDX_BYTES", 1 << 16)  # the real bound is 64 MiB
    path = tmp_path / "bomb.gz"
    with gzip.open(path, "wb") as f:
        f.write(bytes(1 << 20))  # 1 MiB of zeros: a 1 KiB file
    with pytest.raises(UsageError, match="inflates to more than"):
        read_idx(path)


def test_a_copy_that_cannot_be_written_whole_leaves_nothing(tmp_path, monkeypatch):
    """A disk that fills while a copy is written: the load goes on, and neither the copy nor its temporary
    file is left behind (a full disk is not made fuller by every rank of every run)."""
    import pathlib

    import numpy as np

    from paralab.data import decoded
    real = pathlib.Path.write_bytes

    def half_then_full(self, data):
        real(self, data[: len(data) // 2])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(pathlib.Path, "write_bytes", half_then_full)
    arrays = decoded.kept(tmp_path / "copies" / "a.bin", ["x"], lambda: {"x": np.arange(100, dtype=np.uint8)})
    assert arrays["x"].tolist() == list(range(100)) and list((tmp_path / "copies").iterdir()) == []
