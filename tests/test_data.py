import gzip
import pickle
import struct

import numpy as np
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from paralab.data import BatchSource, shard_indices
from paralab.data.datasets import (FASHION_FILES, load_cifar10, load_fashion_mnist, make_synthetic,
                                   read_idx)
from paralab.data.download import info
from paralab.data.transforms import PAD, augmentation_params, crop_flip, normalize
from paralab.errors import UsageError


@pytest.mark.parametrize("n,world", [(10, 1), (10, 3), (11, 4), (7, 2), (3, 5), (256, 2)])
@pytest.mark.parametrize("epoch", [0, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_sharding_matches_distributed_sampler(n, world, epoch, shuffle):
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=7)
        sampler.set_epoch(epoch)
        ours = shard_indices(n, world, rank, seed=7, epoch=epoch, shuffle=shuffle)
        assert ours.tolist() == list(sampler)


def test_shards_of_a_step_form_the_global_batch():
    data = make_synthetic(train_size=200, test_size=40)
    single = BatchSource(data, per_rank_batch=32, replicas=1, seed=3)
    pair = [BatchSource(data, per_rank_batch=16, replicas=2, rank=r, seed=3) for r in range(2)]
    for step in (0, 4, 7):  # step 7 is in the second epoch
        _, whole = single.indices(step)
        parts = torch.cat([s.indices(step)[1] for s in pair])
        assert sorted(whole.tolist()) == sorted(parts.tolist())


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
    with open(path, "wb") as f:
        pickle.dump({b"data": images.reshape(len(images), -1), b"labels": list(labels),
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
    from paralab.launch import free_port
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
