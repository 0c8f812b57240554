"""The bench's data, all from files already on the machine (nothing is downloaded).

* the Python standard library's source (always present): a byte corpus;
* English text: the reStructuredText sources of the Python documentation, from Debian's
  ``python3-doc`` (``/usr/share/doc/python3.X/html/_sources``);
* Fashion-MNIST, from Debian's ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``).

A missing package raises :class:`DataUnavailable` with the command that installs it.
"""

from __future__ import annotations

import glob
import gzip
import math
import os

import numpy as np

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
_DOC_GLOB = "/usr/share/doc/python3*/html/_sources"


class DataUnavailable(RuntimeError):
    """A dataset's Debian package is not installed; the message says how to install it."""


def split_by_file(files: list[str], seed: int, val_share: float = 0.1):
    """``(train bytes, val bytes)`` as uint8 arrays: whole files, shuffled with ``seed``."""
    files = sorted(files)
    order = np.random.default_rng(seed).permutation(len(files))
    n_val = max(1, int(len(files) * val_share))
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    for rank, i in enumerate(order):
        with open(files[i], "rb") as f:
            parts["val" if rank < n_val else "train"].append(f.read())
    return tuple(np.frombuffer(b"\n".join(parts[k]), np.uint8) for k in ("train", "val"))


def stdlib_files() -> list[str]:
    """The standard library's top-level ``*.py`` files."""
    return sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))


def python_doc_files() -> list[str]:
    """The ``.rst.txt`` sources of the Python documentation (Debian's ``python3-doc``)."""
    roots = sorted(glob.glob(_DOC_GLOB))
    files = sorted(f for r in roots for f in glob.glob(os.path.join(r, "**", "*.rst.txt"),
                                                       recursive=True))
    if not files:
        raise DataUnavailable(
            "English text for the 'text-gpt' task comes from Debian's python3-doc package "
            f"(reStructuredText sources under {_DOC_GLOB}), which is not installed.\n"
            "Install it with:  apt-get install -y python3-doc")
    return files


def byte_batches(data: np.ndarray, batch: int, context: int, steps: int, seed: int):
    """``[steps, batch, context + 1]`` int32 windows at seeded random offsets."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(data) - context - 1, (steps, batch))
    return data[starts[..., None] + np.arange(context + 1)].astype(np.int32)


def _read_idx(path: str, expect_dims: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic = int.from_bytes(raw[:4], "big")
    if magic >> 8 != 0x08 or (magic & 0xFF) != expect_dims:  # 0x08: unsigned byte data
        raise ValueError(f"{path}: not an idx uint8 file with {expect_dims} dims "
                         f"(magic {magic:#010x})")
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(expect_dims)]
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * expect_dims)
    if data.size != math.prod(dims):
        raise ValueError(f"{path}: {data.size} bytes of data for dims {dims}")
    return data.reshape(dims)


def load_fashion_mnist(data_dir: str = FASHION_MNIST_DIR):
    """``(train_x uint8 [60000, 28, 28], train_y, test_x [10000, 28, 28], test_y)``."""
    names = {
        "train_x": "train-images-idx3-ubyte.gz", "train_y": "train-labels-idx1-ubyte.gz",
        "test_x": "t10k-images-idx3-ubyte.gz", "test_y": "t10k-labels-idx1-ubyte.gz",
    }
    missing = [n for n in names.values() if not os.path.isfile(os.path.join(data_dir, n))]
    if missing:
        raise DataUnavailable(
            f"Fashion-MNIST not found in {data_dir} (missing {', '.join(missing)}).\n"
            f"Install Debian's package with:  apt-get install -y dataset-fashion-mnist")
    out = [_read_idx(os.path.join(data_dir, n), 3 if k.endswith("x") else 1)
           for k, n in names.items()]
    return tuple(out)


def epoch_indices(n: int, batch: int, steps: int, seed: int) -> np.ndarray:
    """``[steps, batch]`` example indices: seeded shuffled epochs."""
    rng = np.random.default_rng(10_000 + seed)
    per_epoch = n // batch
    epochs = -(-steps // per_epoch)
    idx = [rng.permutation(n)[: per_epoch * batch].reshape(per_epoch, batch)
           for _ in range(epochs)]
    return np.concatenate(idx)[:steps]
