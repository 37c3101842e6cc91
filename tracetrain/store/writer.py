"""The single writer: every insert goes through one task that commits in groups.

Callers `await writer.submit(op)` and resume only once their op is committed, so the gateway never
answers for a call it has not stored. Ops queued while a commit is in flight share the next
transaction: one fsync for many calls. If a batch fails, its ops are retried one by one so a bad op
(a duplicate idempotency key, say) fails alone.

Several gateway processes on one SQLite file take turns through a file lock before they begin a write
transaction. SQLite's own wait for its write lock is a busy handler that sleeps for growing intervals
between tries, so a process that lost a race kept sleeping after the lock was free, and many processes
served far fewer calls with a far longer tail than with this lock (bench/gateway_workers.py).
A blocked `flock` wakes the moment the holder lets go, and the queued ops of the waiting process join its
next batch meanwhile. The wait has no timeout: a process that dies releases the lock with its files, but
one stopped while it holds it (SIGSTOP) holds up the others' writes until it goes on or is killed. Polling
with a timeout instead served less with many processes: a retry also has to win back the GIL from a busy
event loop.

A batch is committed on the event loop itself, not in a worker thread, when `inline()` says nothing else
waits for the loop (the gateway: one HTTP request in progress, the one being recorded) and neither lock
has to be waited for: the file lock is taken without blocking and SQLite is asked for its write lock with
a busy timeout of 0. Either held elsewhere, the batch goes to the thread, which waits for them. Alone,
the hop to the thread and back, and the GIL passing between them, cost more CPU than the commit; under
concurrency the thread keeps the loop serving while one batch fsyncs (bench/gateway_overhead measures
both).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError
from sqlmodel import Session

log = logging.getLogger(__name__)

WriteOp = Callable[[Session], Any]
"""Runs inside the batch's transaction; its return value is handed back to the submitter."""


class StoreWriter:
    def __init__(self, db: Engine, *, max_batch: int = 512, inline: Callable[[], bool] | None = None) -> None:
        """`inline`: whether a batch may be committed on the event loop now (SQLite only, see above)."""
        self.db = db
        self.max_batch = max_batch
        self._inline = inline if db.dialect.name == "sqlite" else None
        self.inline_batches = 0
        self._queue: asyncio.Queue[tuple[WriteOp, asyncio.Future[Any]]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.committed_ops = 0
        self.batches = 0
        self._write_lock = _FileLock(None)

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    async def start(self) -> None:
        self._write_lock = _FileLock(_sqlite_lock_path(self.db))
        self._task = asyncio.create_task(self._run(), name="store-writer")

    async def stop(self) -> None:
        """Commit everything already submitted, then stop."""
        if self._task is None:
            return
        await self._queue.join()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        self._write_lock.close()

    async def submit(self, op: WriteOp) -> Any:
        if self._task is None:
            raise RuntimeError("store writer is not running")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self._queue.put((op, future))
        return await future

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                results = await self._commit_batch([op for op, _ in batch])
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)
            except Exception:
                log.debug("group commit of %d ops failed; retrying them one by one", len(batch))
                for op, future in batch:
                    try:
                        (result,) = await asyncio.to_thread(self._commit, [op])
                        if not future.done():
                            future.set_result(result)
                    except Exception as exc:
                        if not future.done():
                            future.set_exception(exc)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _commit_batch(self, ops: list[WriteOp]) -> list[Any]:
        """On the event loop when `inline()` allows it and no lock is held elsewhere, else in a thread."""
        if self._inline is not None and self._inline():
            try:
                results = self._commit(ops, wait=False)
                self.inline_batches += 1
                return results
            except _LockHeld:
                pass  # the thread waits for it
        return await asyncio.to_thread(self._commit, ops)

    def _commit(self, ops: list[WriteOp], *, wait: bool = True) -> list[Any]:
        """One transaction for `ops`. Without `wait`, `_LockHeld` (nothing done) when another process
        holds the file lock or SQLite's write lock (a trainer's write, say)."""
        if not self._write_lock.acquire(blocking=wait):
            raise _LockHeld
        try:
            with Session(self.db, expire_on_commit=False) as s:
                if self.db.dialect.name == "sqlite":
                    # Take the write lock before the ops read (next call number, idempotency keys): another
                    # gateway process on the same file cannot write in between.
                    _begin_immediate(s, wait=wait)
                results = [op(s) for op in ops]
                s.commit()
        finally:
            self._write_lock.release()
        self.committed_ops += len(ops)
        self.batches += 1
        return results


class _LockHeld(Exception):
    """A commit that must not wait found a write lock held elsewhere."""


def _begin_immediate(db: Session, *, wait: bool) -> None:
    """SQLite's write lock for this transaction; without `wait`, asked for with a busy timeout of 0."""
    if wait:
        db.connection().exec_driver_sql("BEGIN IMMEDIATE")
        return
    driver = db.connection().connection.dbapi_connection
    assert driver is not None
    waits = driver.execute("PRAGMA busy_timeout").fetchone()[0]
    driver.execute("PRAGMA busy_timeout = 0")
    try:
        db.connection().exec_driver_sql("BEGIN IMMEDIATE")
    except OperationalError as exc:
        raise _LockHeld from exc
    finally:
        driver.execute(f"PRAGMA busy_timeout = {int(waits)}")


def _sqlite_lock_path(db: Engine) -> str | None:
    """The lock file beside a SQLite store's file (like its -wal and -shm); None for other stores."""
    database = db.url.database
    if db.dialect.name != "sqlite" or not database or database == ":memory:" or database.startswith("file:"):
        return None
    return database + "-writelock"


class _FileLock:
    """An exclusive `flock` on one file, held from `acquire` to `release`; a no-op without a path or without
    fcntl (Windows, where SQLite's busy handler alone orders the processes). The file stays open between."""

    def __init__(self, path: str | None) -> None:
        self._fd: int | None = None
        if path is not None and fcntl is not None:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def acquire(self, *, blocking: bool = True) -> bool:
        """Take the lock; without `blocking`, False at once when another holder has it."""
        if self._fd is None:
            return True
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
