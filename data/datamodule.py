"""Deterministic training windows and a fixed validation set.

Micro-batch i of rank r is a function of (seed, i, r, world size) and nothing else, so a run resumed at step s sees
exactly the batches an uninterrupted run sees after step s, whatever the number of dataloader workers.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from data.prepare import SAMPLINGS, WINDOW_STARTS
from data.shards import read_shard
from model.config import ConfigError
from model.permutation import seeded_generator


def document_starts(tokens: np.ndarray, eos_id: int, seq_len: int) -> np.ndarray:
    """Offsets where a document begins (0 and after each end-of-text token) with seq_len + 1 tokens from there on."""
    starts = np.concatenate([[0], np.flatnonzero(np.asarray(tokens) == eos_id) + 1])
    return starts[starts + seq_len < tokens.size]


def _check_start(start: str, eos_id: int | None) -> None:
    if start not in WINDOW_STARTS:
        raise ValueError(f"window start {start!r}: choose one of {WINDOW_STARTS}")
    if start == "document" and eos_id is None:
        raise ValueError("document-aligned windows need the end-of-text token id (eos_id)")


class TrainWindows(Dataset):
    """Item i = micro-batch i of this rank: [batch_size, seq_len + 1] tokens of the train shards.

    `sampling="shuffled"` (the default) numbers the windows and takes each once per pass over the corpus, in an order
    drawn from (seed, pass): row b of micro-batch i on rank r is sample t = offset + (i * world + r) * batch_size + b
    of the run, so the ranks and steps of a pass share out its windows without repeats. With `start="any"` the
    windows are a grid of seq_len-token strides (one window's last target is the next one's first input, so every
    token is a target once per pass) whose phase in each shard is drawn per pass too. `sampling="random"` draws each
    row uniformly and independently from (seed, i, rank), nanoGPT's way: over one corpus-worth of tokens that leaves
    ~37% of the corpus unseen and repeats as much (checkpoints from before 2026-12-02 trained so; they resume so).

    `start="any"` opens windows at any token (the usual packed-corpus sampling); `start="document"` only where a
    document begins (offset 0 and after each end-of-text token), so no window opens in the middle of a document: for
    tasks whose answer depends on the document's beginning (the long-range probes) a cut window would hold questions
    whose answer is not in its context at all, and that noise is what the model then learns.
    """

    def __init__(self, shard_paths: list[Path], seq_len: int, batch_size: int, seed: int, rank: int, length: int,
                 start: str = "any", eos_id: int | None = None, sampling: str = "shuffled", world: int = 1,
                 offset: int = 0):
        _check_start(start, eos_id)
        if sampling not in SAMPLINGS:
            raise ValueError(f"sampling {sampling!r}: choose one of {SAMPLINGS}")
        if offset and sampling != "shuffled":
            raise ValueError("an offset into the data stream needs sampling='shuffled'")
        self.paths, self.seq_len, self.batch_size = [str(p) for p in shard_paths], seq_len, batch_size
        self.seed, self.rank, self.length, self.sampling = seed, rank, length, sampling
        self.world, self.offset = world, offset
        self.offsets = None  # per shard, the start offsets of document windows
        self.slack = None  # per shard, the room a shuffled grid's phase has
        sizes = np.array([read_shard(p).size for p in self.paths])
        if start == "document":
            self.offsets = [document_starts(read_shard(p), eos_id, seq_len) for p in self.paths]
            self.windows = np.array([len(o) for o in self.offsets])
        elif sampling == "shuffled":
            targets = np.maximum(sizes - 1, 0)
            self.windows = targets // seq_len
            self.slack = targets - self.windows * seq_len
        else:
            self.windows = np.maximum(sizes - seq_len, 0)
        if self.windows.sum() == 0:  # a ConfigError: train.py prints it as one line, not a traceback
            where = " starting where a document begins" if start == "document" else ""
            raise ConfigError("data.seq_len", seq_len, f"the training shards ({int(sizes.sum()):,} tokens) hold no "
                              f"window of seq_len + 1 = {seq_len + 1} tokens{where}: lower it, or give more text "
                              "(data.source, data.max_tokens)")
        self.cum = np.cumsum(self.windows)
        self._shards = None
        self._pass = None  # (pass, order of the windows, phases of the grids): the pass being read

    def __len__(self):
        return self.length

    def _order(self, p: int):
        if self._pass is None or self._pass[0] != p:
            total = int(self.cum[-1])
            gen = seeded_generator(self.seed, p, -1)  # rank -1: no micro-batch's key of sampling="random"
            order = torch.randperm(total, generator=gen, dtype=torch.int32 if total < 2**31 else torch.int64)
            phases = None if self.slack is None else \
                (torch.rand(len(self.slack), generator=gen, dtype=torch.float64).numpy() * (self.slack + 1)).astype(int)
            self._pass = (p, order.numpy(), phases)
        return self._pass

    def _samples(self, i: int) -> list[tuple[int, np.ndarray | None]]:
        """(window number, the grid phases of its pass or None) of each row of micro-batch i."""
        if self.sampling == "random":
            gen = seeded_generator(self.seed, i, self.rank)
            return [(int(j), None) for j in torch.randint(0, int(self.cum[-1]), (self.batch_size,), generator=gen)]
        first, total, rows = self.offset + (i * self.world + self.rank) * self.batch_size, int(self.cum[-1]), []
        for t in range(first, first + self.batch_size):
            _, order, phases = self._order(t // total)
            rows.append((int(order[t % total]), phases))
        return rows

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._shards is None:  # opened lazily, once per worker process
            self._shards = [read_shard(p) for p in self.paths]
        rows = []
        for j, phases in self._samples(i):
            shard = int(np.searchsorted(self.cum, j, side="right"))
            k = j - int(self.cum[shard - 1] if shard else 0)  # the shard's k-th window
            offset = int(self.offsets[shard][k]) if self.offsets is not None else \
                k if phases is None else int(phases[shard]) + k * self.seq_len
            rows.append(np.asarray(self._shards[shard][offset : offset + self.seq_len + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))


class FixedWindows(Dataset):
    """Non-overlapping validation windows, the same set in every run, spread evenly over the whole validation shard
    (the first ones alone could all come from one book). Candidates are consecutive windows, or with
    `start="document"` (like the training windows) each opening at the next document start after the last; up to
    `max_windows` of them are taken at even strides."""

    def __init__(self, shard_path: Path, seq_len: int, max_windows: int, start: str = "any",
                 eos_id: int | None = None):
        _check_start(start, eos_id)
        tokens = read_shard(shard_path)
        if start == "document":
            offsets, free = [], 0
            for s in document_starts(tokens, eos_id, seq_len):
                if s >= free:
                    offsets.append(int(s))
                    free = s + seq_len
        else:
            offsets = [i * seq_len for i in range((tokens.size - 1) // seq_len)]
        if len(offsets) > max_windows:
            offsets = [offsets[i * len(offsets) // max_windows] for i in range(max_windows)]
        if not offsets:
            where = " starting where a document begins" if start == "document" else ""
            raise ConfigError("data.seq_len", seq_len, f"the validation shard {shard_path} ({tokens.size:,} tokens) "
                              f"holds no window of seq_len + 1 = {seq_len + 1} tokens{where}: lower it, or raise "
                              "data.val_fraction")
        self.windows = torch.from_numpy(
            np.stack([np.asarray(tokens[o : o + seq_len + 1], dtype=np.int64) for o in offsets]))

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return self.windows[i]


class _RemainingBatches:
    """Micro-batch indices start..total-1, with the length of the whole run: a resumed Lightning epoch adds the
    batches it already ran to its fetch count, so a length of only the remaining ones ended the epoch early and
    started a new one that replayed old batches."""

    def __init__(self, start: int, total: int):
        self.start, self.total = start, total

    def __iter__(self):
        return iter(range(self.start, self.total))

    def __len__(self):
        return self.total


class _StepIndexedLoader(DataLoader):
    """The training loader. Micro-batch i is a function of (seed, rank, i) alone, and train_dataloader() starts at the
    trainer's step, so the loader resumes mid-epoch with no state of its own (tests/test_train.py: a resumed run's
    losses equal an uninterrupted run's). The empty state_dict / load_state_dict pair says so to Lightning, which
    otherwise warns at every such resume that the results may be unreliable."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class TokenDataModule(L.LightningDataModule):
    def __init__(self, train_shards, val_shard, seq_len: int, batch_size: int, seed: int = 0, val_windows: int = 64,
                 val_batch_size: int | None = None, num_workers: int = 0, total_micro_batches: int = 10**9,
                 window_start: str = "any", eos_id: int | None = None, sampling: str = "shuffled",
                 sample_offset: int = 0):
        """sample_offset: training samples (windows) to skip, e.g. those an init_from checkpoint trained on."""
        super().__init__()
        self.train_shards, self.val_shard = list(train_shards), val_shard
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.val_windows, self.val_batch_size = val_windows, val_batch_size or batch_size
        self.num_workers, self.total = num_workers, total_micro_batches
        self.window_start, self.eos_id = window_start, eos_id
        self.sampling, self.sample_offset = sampling, sample_offset

    def _start(self) -> int:
        """Micro-batches already consumed: a resumed run continues where it stopped."""
        trainer = self.trainer
        if trainer is None:
            return 0
        return trainer.global_step * trainer.accumulate_grad_batches

    def train_dataloader(self):
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        dataset = TrainWindows(self.train_shards, self.seq_len, self.batch_size, self.seed, rank, self.total,
                               start=self.window_start, eos_id=self.eos_id, sampling=self.sampling, world=world,
                               offset=self.sample_offset)
        return _StepIndexedLoader(dataset, batch_size=None, sampler=_RemainingBatches(self._start(), self.total),
                                  num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def val_dataloader(self):
        dataset = FixedWindows(self.val_shard, self.seq_len, self.val_windows, start=self.window_start,
                               eos_id=self.eos_id)
        return DataLoader(dataset, batch_size=self.val_batch_size, shuffle=False, num_workers=0)
