"""Where a rank's trace records go: a shared memory mapping of its trace file.

The record layout is ``distcheck.files.trace``'s; this module owns the file
mechanics: preallocation and growth, a restarted rank going on after its
records, a forked child writing nothing, and appended writes where a file
system cannot map files.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distcheck.files.trace import SYNC_OFFSET, VERSION_LINE, complete_bytes, header_slots, sync_slot, text_slots


class TraceWriter:
    """Writes one rank's records into a shared memory mapping of its trace file.

    ``append`` is the mapping's own ``write``, or, where the tracer's hot path
    in C is built, a cursor's (``cursor_type``: it keeps the position, and the
    hot path writes through it without a call): one C call either way, so one
    write (a record with its definitions) is never interleaved with another
    thread's.
    It raises ``ValueError`` when the mapping is full (or closed); ``write``
    then grows the file and retries, which is what callers fall back to.
    The file is preallocated with ``posix_fallocate``, so a full disk fails
    here, as an exception, instead of as a SIGBUS in the middle of a record;
    a record that cannot be written is dropped, never raised into the
    user's call. On a file system without shared mappings each record is one
    ``os.write`` to an ``O_APPEND`` file instead (as slow as before: 0.6 µs).
    """

    INITIAL_BYTES = 256 * 1024
    MAX_STEP_BYTES = 64 * 1024 * 1024

    def __init__(self, path: Path, cursor_type: Callable[[], Any] | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.closed = False
        self._lock = threading.Lock()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        # A trace this rank's earlier process wrote (a restarted worker): go on after its whole records.
        existing = os.pread(self.fd, os.fstat(self.fd).st_size, 0)
        used = complete_bytes(existing) if existing.startswith(text_slots(VERSION_LINE)) else 0
        used = used if used >= len(header_slots()) else 0
        os.ftruncate(self.fd, used)   # anything else there is not a trace: start afresh
        self.mm: mmap.mmap | None = None
        self.cursor: Any = None   # where the position is kept instead of the mapping's own
        try:
            size = used + self.INITIAL_BYTES
            _reserve(self.fd, size)
            self.mm = mmap.mmap(self.fd, size)
            if cursor_type is not None:
                self.cursor = cursor_type()
                self.cursor.attach(self.mm, used)
                self.append = self.cursor.write
            else:
                self.mm.seek(used)
                self.append = self.mm.write
        except (OSError, ValueError, BufferError):
            if self.mm is not None:
                self.mm.close()
                self.mm, self.cursor = None, None
            os.ftruncate(self.fd, used)
            os.close(self.fd)
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            self.append = self._append_unmapped
        if used == 0:
            self.write(header_slots())
        me = weakref.ref(self)

        def forget_in_child() -> None:
            w = me()
            if w is not None:
                w._forget()
        os.register_at_fork(after_in_child=forget_in_child)

    def write(self, record: bytes) -> None:
        """Append whole slots, growing the file when the mapping is full; dropped once closed."""
        with self._lock:
            while not self.closed:
                try:
                    self.append(record)
                    return
                except ValueError:
                    if self.closed or self.mm is None:
                        return
                    try:
                        self._grow(len(record))
                    except (OSError, ValueError, BufferError):   # a full disk: the trace ends here
                        return

    def sync(self, t_sync_ns: int, recorder: bool, stack_digest: int = 0) -> None:
        """Overwrite the Y record in place (the sidecar's: every call counted before t_sync_ns is written)."""
        record = sync_slot(t_sync_ns, stack_digest, recorder)
        with self._lock:
            if self.closed:
                return
            try:
                if self.mm is not None:
                    self.mm[SYNC_OFFSET:SYNC_OFFSET + len(record)] = record
                else:
                    with open(self.path, "r+b") as f:   # the append-only descriptor cannot write in place
                        f.seek(SYNC_OFFSET)
                        f.write(record)
            except (OSError, ValueError, IndexError):
                pass   # a sync that cannot be written leaves the watchdog waiting, never the rank failing

    def _append_unmapped(self, record: bytes) -> None:
        """``append`` without a mapping; raises only ValueError, as the mapping's ``write`` does."""
        if self.closed:     # its descriptor may be another file's by now
            raise ValueError("the trace is closed")
        try:
            os.write(self.fd, record)
        except OSError as exc:
            raise ValueError(str(exc)) from None

    def _grow(self, need: int) -> None:
        assert self.mm is not None   # only a mapped trace grows
        size = len(self.mm)
        new = size + max(need, min(size, self.MAX_STEP_BYTES))
        _reserve(self.fd, new)
        if self.cursor is None:
            self.mm.resize(new)
            return
        pos = self.cursor.detach()   # a mapping lent out cannot be resized
        try:
            self.mm.resize(new)
        finally:
            self.cursor.attach(self.mm, pos)

    def _let_go(self) -> int:
        """Close the mapping; the position it was written up to."""
        assert self.mm is not None   # only a mapped trace lets go of its mapping
        used = self.cursor.detach() if self.cursor is not None else self.mm.tell()
        self.mm.close()
        return used

    def close(self) -> None:
        """Trim the unwritten end; later writes (a sidecar thread still polling) are dropped."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                if self.mm is not None:
                    os.ftruncate(self.fd, self._let_go())
            finally:
                os.close(self.fd)

    def _forget(self) -> None:
        """In a forked child (a DataLoader worker): it is not the rank, so it writes nothing here."""
        self.closed = True
        try:
            if self.mm is not None:
                self._let_go()
            os.close(self.fd)
        except (OSError, ValueError, BufferError):
            pass


def _reserve(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, max(size, os.fstat(fd).st_size))   # a file system without it
