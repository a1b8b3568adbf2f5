"""The prefix cache on disk: the prefix pool's blocks (and the recurrent layers' state snapshots)
written to a directory as they are stored, so that a later process serving the same model file,
dtype and KV layout finds them: the first turn after a restart hits (docs/prefix_cache.md, "On
disk").

A file holds one block: its own tokens, the key of the block before it and the pool row's bytes
(every layer, K and V; a snapshot file: every recurrent layer's state after the block). Keys chain
as the in-memory index does: key = SHA-256(previous key, the block's tokens), from a root made of
the model's fingerprint and the request's salt; a file also repeats its tokens and its previous
key, which a read compares. A file is input: one whose fingerprint (another model, dtype, layout or
build), previous key, tokens, length or SHA-256 checksum disagrees is ignored with one warning and
deleted (it lies in this fingerprint's own directory), never read into the KV buffer.

Bounded by bytes (LRU: a read or a write makes a file the newest). Writes go through a thread of
their own (a temporary file, then a rename: a reader never sees half of one); what waits for it is
bounded too (`queue_bytes`; past it a block is not written, and counted). Reads are the
scheduler's, synchronous: a hit of n blocks reads n files at that iteration's boundary.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)

MAGIC = b"FLVRPFX1"
BLOCK, STATE = 1, 2  # a file's kind
# magic, kind, whole, token count, previous key (a state file: its block's key), fingerprint, payload bytes
HEADER = struct.Struct("<8sBBH32s32sQ")
DIGEST = 32  # the SHA-256 of everything before it closes every file
SUFFIX = {BLOCK: ".block", STATE: ".state"}


def chain_key(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block of `tokens` after the block (or root) keyed `previous`."""
    return hashlib.sha256(previous + struct.pack(f"<{len(tokens)}i", *tokens)).digest()


@dataclass(frozen=True)
class DiskBlock:
    whole: bool  # holds the windowed layers' rows too (kv_window.py)
    payload: bytes


@dataclass
class DiskStats:
    blocks_read: int = 0
    blocks_written: int = 0
    states_read: int = 0
    states_written: int = 0
    files_ignored: int = 0  # foreign, truncated or tampered files (each warned about once, deleted)
    writes_dropped: int = 0  # blocks not written: the writer was `queue_bytes` behind


class PrefixDisk:
    def __init__(self, root: str | Path, fingerprint: bytes, max_bytes: int, queue_bytes: int = 256 * 2**20):
        """`fingerprint`: 32 bytes naming the model, dtype, KV layout and build (a process with
        another one reads none of these files); `max_bytes`: the files' bound."""
        self.fingerprint, self.max_bytes, self.queue_bytes = fingerprint, max_bytes, queue_bytes
        self.dir = Path(root) / fingerprint.hex()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = DiskStats()
        self._lock = threading.Lock()  # the index and byte counts: the writer thread's and the scheduler's
        self._files: OrderedDict[str, int] = OrderedDict()  # name -> bytes, least recently used first
        self._bytes = self._queued = 0
        for path in sorted(self.dir.iterdir(), key=_mtime):
            if path.suffix in SUFFIX.values():
                self._files[path.name] = path.stat().st_size
                self._bytes += self._files[path.name]
            elif ".tmp-" in path.name:  # a write a process did not finish
                path.unlink(missing_ok=True)
        with self._lock:
            self._evict()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk", daemon=True)
        self._writer.start()

    def root(self, salt: str | None) -> bytes:
        """What a sequence's first block chains from: the fingerprint and the salt's digest."""
        partition = b"" if salt is None else hashlib.sha256(salt.encode()).digest()
        return hashlib.sha256(b"root" + self.fingerprint + partition).digest()

    @property
    def files(self) -> int:
        return len(self._files)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def has(self, key: bytes, kind: int = BLOCK) -> bool:
        return _name(key, kind) in self._files

    # -- reads (the scheduler's) ----------------------------------------------------------------
    def read_block(self, key: bytes, previous: bytes, tokens: Sequence[int], nbytes: int) -> DiskBlock | None:
        """The block keyed `key` if its file holds exactly it (None: no file, or a bad one)."""
        got = self._read(key, BLOCK, previous, tuple(tokens), nbytes)
        if got is not None:
            self.stats.blocks_read += 1
        return got

    def read_state(self, key: bytes, nbytes: int) -> bytes | None:
        """The recurrent layers' states after the block keyed `key` (None: none, or a bad file)."""
        got = self._read(key, STATE, key, (), nbytes)
        if got is None:
            return None
        self.stats.states_read += 1
        return got.payload

    def _read(self, key: bytes, kind: int, previous: bytes, tokens: tuple, nbytes: int) -> DiskBlock | None:
        name = _name(key, kind)
        with self._lock:
            if name not in self._files:
                return None
            self._files.move_to_end(name)
        path = self.dir / name
        try:
            data = path.read_bytes()
            os.utime(path)  # (the next process's LRU order)
        except OSError:
            self._forget(name)
            return None
        why = self._check(data, kind, previous, tokens, nbytes)
        if why is not None:
            log.warning("prefix cache on disk: ignoring %s: %s", path, why)
            self.stats.files_ignored += 1
            self._forget(name, delete=True)
            return None
        return DiskBlock(bool(data[9]), data[HEADER.size + 4 * len(tokens) : -DIGEST])

    def _check(self, data: bytes, kind: int, previous: bytes, tokens: tuple, nbytes: int) -> str | None:
        """Why `data` is not the file asked for (None: it is)."""
        size = HEADER.size + 4 * len(tokens) + nbytes + DIGEST
        if len(data) != size:
            return f"{len(data)} bytes where the file would have {size} (truncated or another layout)"
        magic, got_kind, _whole, count, got_previous, fingerprint, payload = HEADER.unpack_from(data)
        if magic != MAGIC or got_kind != kind:
            return "not a flover prefix cache file of this kind"
        if fingerprint != self.fingerprint:
            return "written for another model, dtype, KV layout or build"
        if hashlib.sha256(data[:-DIGEST]).digest() != data[-DIGEST:]:
            return "its checksum does not match (changed after it was written)"
        if count != len(tokens) or payload != nbytes or got_previous != previous:
            return "it holds another block than its name says"
        if struct.unpack_from(f"<{count}i", data, HEADER.size) != tokens:
            return "it holds other tokens than its name says"
        return None

    def _forget(self, name: str, delete: bool = False) -> None:
        with self._lock:
            self._bytes -= self._files.pop(name, 0)
        if delete:
            (self.dir / name).unlink(missing_ok=True)

    # -- writes (queued; the writer thread's) ---------------------------------------------------
    def write_block(self, key: bytes, previous: bytes, tokens: Sequence[int], whole: bool, payload: bytes) -> None:
        self._enqueue(key, BLOCK, previous, tuple(tokens), whole, payload)

    def write_state(self, key: bytes, payload: bytes) -> None:
        self._enqueue(key, STATE, key, (), True, payload)

    def _enqueue(self, key: bytes, kind: int, previous: bytes, tokens: tuple, whole: bool, payload: bytes) -> None:
        if self.has(key, kind):
            return
        name = _name(key, kind)
        head = HEADER.pack(MAGIC, kind, int(whole), len(tokens), previous, self.fingerprint, len(payload))
        body = head + struct.pack(f"<{len(tokens)}i", *tokens) + payload
        with self._lock:
            if self._queued + len(body) > self.queue_bytes:
                self.stats.writes_dropped += 1
                return
            self._queued += len(body)
        self._queue.put((name, kind, body))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                name, kind, body = item
                self._write(name, kind, body)
            finally:
                self._queue.task_done()

    def _write(self, name: str, kind: int, body: bytes) -> None:
        data = body + hashlib.sha256(body).digest()
        path, temporary = self.dir / name, self.dir / f"{name}.tmp-{os.getpid()}"
        try:
            temporary.write_bytes(data)
            os.replace(temporary, path)
        except OSError as e:
            log.warning("prefix cache on disk: cannot write %s: %s", path, e)
            temporary.unlink(missing_ok=True)
            with self._lock:
                self._queued -= len(body)
            return
        with self._lock:
            self._queued -= len(body)
            self._bytes += len(data) - self._files.pop(name, 0)
            self._files[name] = len(data)
            self._evict(keep=name)
        if kind == BLOCK:
            self.stats.blocks_written += 1
        else:
            self.stats.states_written += 1

    def _evict(self, keep: str | None = None) -> None:
        """Least recently used files go while the bytes exceed the bound (under the lock)."""
        while self._bytes > self.max_bytes and self._files:
            name = next(iter(self._files))
            if name == keep:
                if len(self._files) == 1:
                    return
                self._files.move_to_end(name)
                continue
            self._bytes -= self._files.pop(name)
            (self.dir / name).unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait until every queued file is written."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()


def fingerprint(parts: Sequence[object]) -> bytes:
    """32 bytes naming what a file's KV depends on: the parts' reprs, in order."""
    return hashlib.sha256(repr(list(parts)).encode()).digest()


def checkpoint_digest(path: str | Path, edge: int = 2**20) -> str:
    """A model file's (or a directory's files') identity without reading all of it: each file's
    name, size and the SHA-256 of its first and last `edge` bytes (weights, config, tokenizer)."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(edge)
            f.seek(max(size - edge, 0))
            tail = f.read(edge)
        digest.update(f"{file.name}:{size}:".encode() + hashlib.sha256(head + tail).digest())
    return digest.hexdigest()


def _name(key: bytes, kind: int) -> str:
    return key.hex() + SUFFIX[kind]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
