"""The bounded, streamed upload of a payload file to an object store, and what a failed one left.

An object store's fsspec file publishes the object only when it closes, so a file streamed
block by block is never seen half-written and the upload holds about a block, not a second
copy. With a timeout every call of the upload is bounded, and a failed upload is aborted so
that nothing completes it later: an s3fs abort the store does not confirm is retried in the
background (:mod:`r3data.payload.abort_retry`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from fsspec import AbstractFileSystem

from r3data.payload.abort_retry import (
    published,
    retry_abort,
    retry_removal,
    watch_publish,
    watch_uploads,
)
from r3data.payload.deadline import bounded, on_event_loop, within
from r3data.payload.fs import PayloadRoot

__all__ = ["byte_view", "removal", "remove_quietly", "upload"]

logger = logging.getLogger(__name__)

_STREAM_CHUNK = 8 << 20
"""Bytes per write into an object store's file when it does not say its block size."""


def upload(root: PayloadRoot, path: str, url: str, parts: list[Any]) -> None:
    """Stream ``parts`` into one upload that the store publishes when the file closes.

    Object stores' fsspec files (s3fs, gcsfs, adlfs) buffer a block at a time (one put below
    the block size, a multipart upload above it) and make the object visible only at close: the
    file is never seen half-written, and the upload holds about a block, not a second copy of
    the file. On failure the upload is discarded and the file marked closed, so that nothing
    (not even garbage collection) completes it.

    With a timeout, each call is bounded: on an s3fs file every request it makes (creating the
    multipart upload, each part, the completion or the single put) runs on s3fs's event loop
    and is cancelled at its deadline (:func:`_bound_requests`), so an abandoned publish never
    completes later; on any other file the open, each block's write and the close run with
    :func:`~r3data.payload.deadline.within`, and a close abandoned at its deadline that
    completes after all has what it published deleted as it returns.
    """
    fs, timeout = root.fs, root.timeout
    out = within(timeout, f"opening {url}", partial(fs.open, path, "wb"), fs, late=_abandon)
    requests = None if timeout is None else _bound_requests(out, timeout, url)

    def step(doing: str, call: Callable[[], Any], late: Callable[[Any], None] | None = None) -> Any:
        if requests is not None:
            return call()  # each request the call makes has its own deadline
        return within(timeout, doing, call, fs, late=late)

    chunk = getattr(out, "blocksize", None) or _STREAM_CHUNK
    publishing = False
    try:
        written = 0
        for part in parts:
            view = byte_view(part)
            for start in range(0, len(view), chunk):
                piece = view[start : start + chunk]
                step(f"writing {url} at offset {written}", partial(out.write, piece))
                written += len(piece)
        publishing = True
        step(f"publishing {url}", out.close, late=removal(root, path, url))
    except BaseException as error:
        _abort(out, root, path, url, requests, publishing and not _refused(error))
        raise


class _BoundRequests:
    """The requests of one s3fs file (``S3File``), each given the deadline ``timeout``; notes
    whether the creation of its multipart upload failed with its outcome in doubt, so that the
    store may hold an upload whose id nobody got.

    An ``S3File`` makes every request of an upload (create the multipart upload, upload each
    part, complete it, or the single ``put_object`` of a small file) through its ``_call_s3``,
    which runs s3fs's ``_call_s3`` coroutine on the filesystem's event loop with no deadline,
    for as long as botocore's and s3fs's retries add up to. Installed as this file's
    ``_call_s3`` (its own attribute: no other file or caller of the filesystem is touched), it
    runs the same coroutine through :func:`~r3data.payload.deadline.bounded`, which cancels it
    at its deadline: the request's connection is closed, and nothing retries it later."""

    def __init__(self, out: Any, timeout: float, url: str) -> None:
        self.out, self.timeout, self.url = out, timeout, url
        self.creation_in_doubt = False

    def __call__(self, method: str, *kwarglist: Any, **kwargs: Any) -> Any:
        out = self.out
        extra = (out.s3_additional_kwargs, out._request_payer_kw)  # what S3File._call_s3 adds
        doing = f"{method} of {self.url}"
        try:
            return bounded(
                out.fs, self.timeout, doing, "call_s3", method, *extra, *kwarglist, **kwargs
            )
        except BaseException as error:
            if method == "create_multipart_upload" and not _refused(error):
                self.creation_in_doubt = True
            raise


def _bound_requests(out: Any, timeout: float, url: str) -> _BoundRequests | None:
    """Give each request of ``out``, an s3fs file, the deadline ``timeout``
    (:class:`_BoundRequests`); None (nothing changed) for any other file."""
    inner = getattr(out, "fs", None)
    if not callable(getattr(type(out), "_call_s3", None)) or inner is None:
        return None
    if on_event_loop(inner, "call_s3") is None:
        return None
    out._call_s3 = requests = _BoundRequests(out, timeout, url)
    return requests


def _refused(error: BaseException) -> bool:
    """Whether the store answered the request that raised ``error`` with a refusal (an HTTP
    4xx: denied, no such bucket, bad request), so that it did not and will not act on it.

    Anything else leaves the outcome in doubt: a timeout or a lost connection (the network may
    still hold the request), a 5xx (the store may have acted before failing), an interrupt.
    s3fs raises a botocore ``ClientError``, or a Python error it translated from one and caused
    by it; either carries the store's HTTP status."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return isinstance(status, int) and 400 <= status < 500
        cause = cause.__cause__
    return False


def _abort(
    out: Any,
    root: PayloadRoot,
    path: str,
    url: str,
    requests: _BoundRequests | None,
    in_doubt: bool,
) -> None:
    """Discard the upload of ``out`` and mark the file closed, so that nothing completes it
    later; failures here are not the error to report. ``in_doubt``: the publish failed without
    the store's refusal (:func:`_refused`), so that it may still land.

    An s3fs multipart upload is aborted here, bounded by the root's timeout (``discard`` would
    wait without one); when the store does not confirm the abort, it is tried again in the
    background (:func:`~r3data.payload.abort_retry.retry_abort`), then the final name deleted
    should a completion the network still held have published it. A single put that failed
    cannot be aborted: unless the store refused it, its final name is watched in the
    background (:func:`~r3data.payload.abort_retry.watch_publish`), should its body, which the
    network still held, land."""
    timeout = root.timeout
    try:
        if requests is not None:
            mpu, out.mpu = getattr(out, "mpu", None), None
            if mpu:
                abort = partial(_abort_upload, out.fs, timeout, url, out.bucket, out.key, mpu)
                try:
                    abort()
                except FileNotFoundError:  # gone: completed (then deleted) or aborted already
                    pass
                except Exception:
                    retry_abort(url, abort, root, path)
            elif requests.creation_in_doubt:
                orphans = partial(_abort_uploads_of, out.fs, timeout, url, out.bucket, out.key)
                watch_uploads(url, orphans, root, path)
            elif in_doubt:
                watch_publish(url, root, path)
            out.discard()
        else:
            within(timeout, f"aborting the upload of {url}", out.discard, root.fs)
    except Exception as exc:
        logger.debug("discarding the upload of %s: %s", url, exc)
    _mark_closed(out)


def _abort_upload(
    fs: AbstractFileSystem, timeout: float | None, url: str, bucket: str, key: str, mpu: Any
) -> None:
    doing = f"aborting the upload of {url}"
    bounded(fs, timeout, doing, "abort_mpu", bucket, key, mpu["UploadId"])


def _abort_uploads_of(
    fs: AbstractFileSystem, timeout: float | None, url: str, bucket: str, key: str
) -> None:
    """Abort every multipart upload of ``key`` the store holds (each write's key is a fresh
    uuid4, so none is another write's)."""
    doing = f"listing the uploads of {url}"
    listing = bounded(
        fs, timeout, doing, "call_s3", "list_multipart_uploads", Bucket=bucket, Prefix=key
    )
    for upload in listing.get("Uploads", []):
        if upload.get("Key") == key:
            with contextlib.suppress(FileNotFoundError):  # aborted meanwhile
                _abort_upload(fs, timeout, url, bucket, key, {"UploadId": upload["UploadId"]})
                logger.info("aborted the upload of %s that a late creation made", url)


def _abandon(out: Any) -> None:
    """A file opened after its caller gave up: discarded unpublished, never closed."""
    with contextlib.suppress(Exception):
        out.discard()
    _mark_closed(out)


def _mark_closed(out: Any) -> None:
    """Mark ``out`` closed, so that nothing (not even garbage collection) publishes it."""
    with contextlib.suppress(AttributeError):
        out.closed = True


def remove_quietly(root: PayloadRoot, path: str, url: str) -> None:
    """Delete ``path`` if a failed write left it (a filesystem that shows files while they are
    written, a publish that completed after its deadline), each call bounded by the root's
    timeout; a failure to look or delete is not the error to report: it is tried again in the
    background (:func:`~r3data.payload.abort_retry.retry_removal`)."""
    try:
        if published(root, path):
            root.call("rm_file", path)
    except Exception as exc:
        logger.debug("removing what a failed write left at %s: %s", url, exc)
        retry_removal(url, root, path)


def removal(root: PayloadRoot, path: str, url: str) -> Callable[[Any], None]:
    """What a publish abandoned at its deadline does if it completes after all (``late`` of
    :func:`~r3data.payload.deadline.within`): delete what it published."""
    return lambda _: remove_quietly(root, path, url)


def byte_view(buffer: np.ndarray | bytes) -> memoryview:
    if isinstance(buffer, np.ndarray):
        return memoryview(buffer.reshape(-1).view(np.uint8))
    return memoryview(buffer)
