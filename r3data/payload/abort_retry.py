"""What a failed upload may still leave, undone in the background.

A request held in the network past its cancellation (a completion the store takes once it
answers again, a single put's body, a multipart upload's creation) could publish a file, or
leave an upload nobody aborts, after its writer was told the write failed. Each such upload is
a cleanup on one daemon thread, tried until the store confirms or :data:`CLEANUP_HORIZON_S`
has passed: an abort the store did not confirm, tried again, then the final name deleted if it
was published; a failed single put's final name watched and deleted should it show; the
uploads of a key whose creation got no answer listed and aborted; a deletion of what a failed
write left that failed, tried again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

from r3data.payload.fs import PayloadRoot

__all__ = [
    "CLEANUP_HORIZON_S",
    "published",
    "retry_abort",
    "retry_removal",
    "watch_publish",
    "watch_uploads",
]

logger = logging.getLogger(__name__)

CLEANUP_HORIZON_S = 15 * 60.0
"""How long a failed upload whose abort the store did not answer is tried again (abort, then
delete the final name), in the background: a request held in the network past its
cancellation (a completion the store takes once it answers again) could otherwise publish
the file after its writer was told it failed. S3 refuses a request signed more than 15
minutes before it arrives."""

MAX_PENDING_CLEANUPS = 1024
"""Failed uploads waiting for their abort at once; past it the oldest is given up (logged)."""


def retry_abort(url: str, abort: Callable[[], None], root: PayloadRoot, path: str) -> None:
    """Try ``abort`` (raises ``FileNotFoundError`` when the upload is gone) again in the
    background, then delete ``path`` should a completion the network still held have
    published it."""
    _cleanups.add(_Cleanup(url, abort, root, path))


def watch_publish(url: str, root: PayloadRoot, path: str) -> None:
    """Look for ``path`` in the background until :data:`CLEANUP_HORIZON_S` has passed and
    delete it should it show: a single put past its deadline cannot be aborted, and its body
    the network still held lands once the store takes it."""
    _cleanups.add(_Cleanup(url, None, root, path, watch=True))


def watch_uploads(url: str, abort: Callable[[], None], root: PayloadRoot, path: str) -> None:
    """Call ``abort`` (abort every multipart upload the store holds for ``path``) in the
    background until :data:`CLEANUP_HORIZON_S` has passed: a creation past its deadline left no
    upload id, and the creation the network still held makes an upload once the store takes
    it, which nobody would abort."""
    _cleanups.add(_Cleanup(url, abort, root, path, watch=True))


def retry_removal(url: str, root: PayloadRoot, path: str) -> None:
    """Delete ``path`` in the background, should it exist, until the store confirms (a
    deletion of what a failed write left that failed or timed out)."""
    _cleanups.add(_Cleanup(url, None, root, path))


def published(root: PayloadRoot, path: str) -> bool:
    """Whether ``path`` exists now (no listing cached before a late publish hides it)."""
    root.fs.invalidate_cache(path)
    return bool(root.call("exists", path))


class _Cleanup:
    """One failed upload's cleanup: ``abort`` if any (raises ``FileNotFoundError`` when the
    upload is gone), then delete ``path`` if it was published; with ``watch``, again until the
    horizon (a put that cannot be aborted, or a creation that left no upload id, may still
    land), ``abort`` included."""

    def __init__(
        self,
        url: str,
        abort: Callable[[], None] | None,
        root: PayloadRoot,
        path: str,
        watch: bool = False,
    ) -> None:
        self.url, self.abort, self.root, self.path, self.watch = url, abort, root, path, watch
        self.until = time.monotonic() + CLEANUP_HORIZON_S
        self.wait = root.timeout or 1.0  # till the next try: doubles to a minute, its own
        self.due = time.monotonic() + self.wait

    def later(self) -> None:
        """Try again after twice the last wait (at most a minute)."""
        self.wait = min(2 * self.wait, 60.0)
        self.due = time.monotonic() + self.wait

    def attempt(self) -> bool:
        """Abort the upload and delete the final name if it was published; raises while the
        store does not confirm either. False while a watched put could still land."""
        if self.abort is not None:
            with contextlib.suppress(FileNotFoundError):
                self.abort()
            if not self.watch:
                self.abort = None  # confirmed: from now on no completion can succeed
        if published(self.root, self.path):  # completed before the abort: delete it
            self.root.call("rm_file", self.path)
            return True
        return not self.watch


class _Cleanups:
    """Failed uploads tried again on one daemon thread, each every ``timeout`` (doubling to a
    minute, its own schedule: one added while another waits a minute is tried after its own
    ``timeout``) until confirmed or :data:`CLEANUP_HORIZON_S` passed; each call is bounded by
    its root's timeout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._added = threading.Event()
        self._pending: list[_Cleanup] = []
        self._thread: threading.Thread | None = None

    def add(self, cleanup: _Cleanup) -> None:
        if cleanup.watch and cleanup.abort is not None:
            what, then = "the creation of the multipart upload", "its uploads listed and aborted"
        elif cleanup.watch:
            what, then = "the put", "its final name watched"
        elif cleanup.abort is not None:
            what, then = "the abort of the upload", "tried again"
        else:
            what, then = "the deletion of what a failed write left", "tried again"
        logger.warning(
            "the store did not confirm %s of %s: %s in the background for up to %g s",
            what,
            cleanup.url,
            then,
            CLEANUP_HORIZON_S,
        )
        with self._lock:
            self._pending.append(cleanup)
            if len(self._pending) > MAX_PENDING_CLEANUPS:
                dropped = self._pending.pop(0)
                logger.warning("giving up the cleanup of the upload of %s", dropped.url)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="r3data-writer-cleanup", daemon=True
                )
                self._thread.start()
        self._added.set()

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _run(self) -> None:
        while True:
            with self._lock:
                pending = list(self._pending)
                if not pending:
                    self._thread = None
                    return
                self._added.clear()
            now = time.monotonic()
            due = [cleanup for cleanup in pending if cleanup.due <= now]
            if not due:
                self._added.wait(min(cleanup.due for cleanup in pending) - now)
                continue
            for cleanup in due:
                try:
                    if not cleanup.attempt() and time.monotonic() < cleanup.until:
                        cleanup.later()  # a watched put not landed (yet)
                        continue
                except Exception as exc:
                    logger.debug("cleanup of the upload of %s: %s", cleanup.url, exc)
                    if time.monotonic() < cleanup.until:
                        cleanup.later()
                        continue
                    logger.warning("giving up the cleanup of the upload of %s", cleanup.url)
                with self._lock:
                    if cleanup in self._pending:  # else given up past the limit meanwhile
                        self._pending.remove(cleanup)


_cleanups = _Cleanups()


def _forget_cleanups_in_child() -> None:
    """In a forked child the parent's cleanup thread does not exist (its lock may be held)."""
    global _cleanups
    _cleanups = _Cleanups()


os.register_at_fork(after_in_child=_forget_cleanups_in_child)
