"""The token-shard format: a 64-byte header (magic, version, dtype, token count) then the raw tokens.

Written atomically (temporary file in the same folder, fsync, rename), so a crash never leaves a half shard that
looks whole. Read back as a memmap after checking magic, version, dtype and that the size matches the header.
"""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

import numpy as np

MAGIC = b"SALMTOK\x00"
VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sIIQ")  # magic, version, dtype code, token count
_DTYPES = {1: np.uint16, 2: np.uint32}


class ShardError(ValueError):
    pass


def dtype_for_vocab(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _umask() -> int:
    """The process's umask, from Linux's /proc where it can: os.umask reads it only by setting it, a moment in which
    another thread's new files would be world-writable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically: a reader never sees half a results file."""
    atomic_write_bytes(path, [text.encode("utf-8")])


def atomic_write_bytes(path: Path, chunks) -> None:
    """Write an iterable of byte chunks to `path` atomically."""
    atomic_write(path, lambda f: [f.write(chunk) for chunk in chunks])


def atomic_write(path: Path, write) -> None:
    """Call write(binary file) on a temporary file beside `path`, then rename it to `path`: a reader (or a crash)
    never sees half a file. The file's bytes reach the disk before the rename, and the rename before this returns."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would hide results and shards from the rest of a team
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    """fsync a folder: its entries (a rename into it) on disk, which a power loss could otherwise undo. Where a
    folder cannot be opened or synced (Windows, some network file systems) the rename stands as it is."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_shard(path: Path, tokens: np.ndarray) -> None:
    code = {np.dtype(v): k for k, v in _DTYPES.items()}.get(tokens.dtype)
    if code is None:
        raise ShardError(f"shard tokens must be uint16 or uint32, got {tokens.dtype}")
    header = _HEADER.pack(MAGIC, VERSION, code, tokens.size).ljust(HEADER_BYTES, b"\x00")
    atomic_write_bytes(path, [header, np.ascontiguousarray(tokens).tobytes()])


def read_shard(path: Path) -> np.memmap:
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"token shard {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:8] != MAGIC:
        raise ShardError(f"{path} is not a token shard (bad magic); delete it and prepare the data again")
    _, version, code, count = _HEADER.unpack(head[: _HEADER.size])
    if version != VERSION or code not in _DTYPES:
        raise ShardError(f"{path}: unsupported shard version {version} / dtype code {code}")
    dtype = np.dtype(_DTYPES[code])
    if size != HEADER_BYTES + count * dtype.itemsize:
        raise ShardError(
            f"{path} is truncated or corrupt: header says {count} tokens ({HEADER_BYTES + count * dtype.itemsize} "
            f"bytes) but the file has {size} bytes; delete the data folder to prepare it again"
        )
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))
