"""Readers over a `mixed_shards` folder (see docs/CONTRACTS.md).

Training order is a seeded permutation per epoch, cut into micro-batches; data-parallel rank r of
W takes global batches position + r of each round of W. The cursor (epoch, position) counts
global batches, so it means the same thing on every rank and survives a change of world size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def load_manifest(mixed_shards_dir: str | Path) -> dict:
    manifest = json.loads((Path(mixed_shards_dir) / "manifest.json").read_text())
    if manifest["dtype"] not in _DTYPES:
        raise ValueError(f"unsupported token dtype {manifest['dtype']!r}")
    return manifest


def open_sequences(path: str | Path, dtype: str, seq_len: int, num_sequences: int | None = None) -> np.memmap:
    """Memory-map a flat token file as (N, seq_len + 1) rows."""
    np_dtype = _DTYPES[dtype]
    row = seq_len + 1
    size = Path(path).stat().st_size
    itemsize = np.dtype(np_dtype).itemsize
    if size % (row * itemsize):
        raise ValueError(f"{path}: {size} bytes is not a whole number of {row}-token rows")
    rows = size // (row * itemsize)
    if num_sequences is not None and rows != num_sequences:
        raise ValueError(f"{path}: holds {rows} sequences, manifest says {num_sequences}")
    if rows == 0:
        raise ValueError(f"{path}: no sequences")
    # Little-endian per the contract; '<' makes that explicit on any host.
    return np.memmap(path, dtype=np.dtype(np_dtype).newbyteorder("<"), mode="r", shape=(rows, row))


def _to_pair(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.from_numpy(np.asarray(rows, dtype=np.int64))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class TrainBatches:
    """Deterministic, resumable micro-batches of `train.bin` for one data-parallel rank."""

    def __init__(self, mixed_shards_dir: str | Path, micro_batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        manifest = load_manifest(mixed_shards_dir)
        self.seq_len = int(manifest["seq_len"])
        self.sequences = open_sequences(
            Path(mixed_shards_dir) / manifest["train"]["file"], manifest["dtype"], self.seq_len,
            manifest["train"]["num_sequences"],
        )
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        # A trailing partial batch, and a trailing partial round, are dropped so every rank
        # always gets a full batch (an uneven rank would hang the collective ops).
        self.batches_per_epoch = len(self.sequences) // micro_batch_size
        if self.batches_per_epoch < world_size:
            raise ValueError(
                f"{len(self.sequences)} sequences make {self.batches_per_epoch} batches of "
                f"{micro_batch_size}: fewer than the {world_size} ranks"
            )
        self.epoch = 0
        self.position = 0  # index of the first global batch of the next round
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.sequences))
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 (micro_batch_size, seq_len)."""
        if self.position + self.world_size > self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        batch = self.position + self.rank
        rows = self._epoch_order()[batch * self.micro_batch_size:(batch + 1) * self.micro_batch_size]
        self.position += self.world_size
        # Sorted reads are sequential on disk; order within a batch does not change the loss.
        return _to_pair(self.sequences[np.sort(rows)])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["micro_batch_size"] != self.micro_batch_size:
            raise ValueError(
                f"data cursor was saved with seed={state['seed']}, micro_batch_size="
                f"{state['micro_batch_size']}; this run has seed={self.seed}, "
                f"micro_batch_size={self.micro_batch_size}, so the order would differ"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def validation_buckets(mixed_shards_dir: str | Path) -> list[str]:
    return sorted(load_manifest(mixed_shards_dir).get("validation", {}))


def validation_batches(mixed_shards_dir: str | Path, bucket: str, batch_size: int,
                       max_sequences: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first `max_sequences` rows of `val_<bucket>.bin`, in file order, as (inputs, targets)."""
    manifest = load_manifest(mixed_shards_dir)
    entry = manifest["validation"][bucket]
    sequences = open_sequences(
        Path(mixed_shards_dir) / entry["file"], manifest["dtype"], int(manifest["seq_len"]),
        entry.get("num_sequences"),
    )
    stop = len(sequences) if max_sequences is None else min(max_sequences, len(sequences))
    for start in range(0, stop, batch_size):
        yield _to_pair(sequences[start:min(start + batch_size, stop)])
