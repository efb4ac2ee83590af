"""A real loopback TCP proxy between a client and the S3 store, switchable to a slow store.

:class:`SlowProxy` listens on a free loopback port and forwards every connection to the
store's S3 port, on an asyncio loop of its own thread, in one of three modes: ``"pass"``
(forward as it comes), ``"stall"`` (keep every connection open, accept new ones, forward
nothing in either direction: a store that stopped answering) and ``"trickle"`` (the store's
answers go out ``trickle_bytes`` at a time, one piece every ``trickle_s`` seconds). A stall
may be limited to the connections whose request line starts with ``only`` (``b"DELETE"``: a
store that lists and reads but never answers a deletion), or matches it when it is a compiled
pattern (``re.compile(rb"POST [^ ]*[?&]uploadId=")``: a store that never answers the
completion of a multipart upload). With ``bodies=True`` a stall holds only what the client
sends after a matching request's first read (a put's body, which botocore sends once the
store answered ``100 Continue``), everything else flowing: a store that took the request but
never the body, which it gets (and acts on) once the stall ends. A switch applies at once to every
connection, open or new, so the faults are real network behaviour: the client's own
timeouts, retries and cancellations meet them as they would a real store's.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

MODES = ("pass", "stall", "trickle")
READ_BYTES = 64 << 10
REQUEST_LINE = re.compile(rb"(?:GET|HEAD|PUT|POST|DELETE) ")
REQUEST_LINE_BYTES = 2048
"""The most of a request line kept to match ``only`` against (S3 keys are at most 1 KiB)."""
T = TypeVar("T")


class SlowProxy:
    """Forwards ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream>``; see the module docstring."""

    def __init__(self, upstream: int, trickle_bytes: int = 16 << 10, trickle_s: float = 0.02):
        self.upstream = upstream
        self.trickle_bytes, self.trickle_s = trickle_bytes, trickle_s
        self.mode, self.only, self.bodies = "pass", b"", False
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._switched = asyncio.Condition()
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = self._run(self._start())
        self.port: int = self._server.sockets[0].getsockname()[1]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._serve, "127.0.0.1", 0)

    def set_mode(
        self, mode: str, only: bytes | re.Pattern[bytes] = b"", bodies: bool = False
    ) -> None:
        """Switch every connection, open or new, to ``mode`` (one of :data:`MODES`); a stall
        ``only`` of the connections whose latest request line starts with ``only`` (or matches
        it, a compiled pattern), if given; with ``bodies``, only their requests' bodies."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, found {mode!r}")

        async def switch() -> None:
            async with self._switched:
                self.mode, self.only, self.bodies = mode, only, bodies
                self._switched.notify_all()

        self._run(switch())

    @contextmanager
    def mode_for(
        self, mode: str, only: bytes | re.Pattern[bytes] = b"", bodies: bool = False
    ) -> Iterator[SlowProxy]:
        """``mode`` (see :meth:`set_mode`) inside the block, ``"pass"`` after it."""
        self.set_mode(mode, only, bodies)
        try:
            yield self
        finally:
            self.set_mode("pass")

    def _stalls(self, request: list[bytes], body: bool = False) -> bool:
        if self.mode != "stall" or (self.bodies and not body):
            return False
        if isinstance(self.only, re.Pattern):
            return self.only.match(request[0]) is not None
        return request[0].startswith(self.only)

    async def _flowing(self, request: list[bytes], body: bool = False) -> None:
        """Return once the connection whose latest request began ``request[0]`` may flow
        (``body``: what it sends after the request's first read)."""
        if not self._stalls(request, body):
            return
        async with self._switched:
            await self._switched.wait_for(lambda: not self._stalls(request, body))

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            store_r, store_w = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            client_w.close()
            return
        self._writers.update((client_w, store_w))
        request = [b""]  # the start of the connection's latest request, shared by both pipes
        try:
            await asyncio.gather(
                self._pipe(client_r, store_w, request, answers=False),
                self._pipe(store_r, client_w, request, answers=True),
            )
        finally:
            for w in (client_w, store_w):
                self._writers.discard(w)
                w.close()

    async def _pipe(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        request: list[bytes],
        answers: bool,
    ) -> None:
        try:
            while True:
                await self._flowing(request)
                data = await src.read(READ_BYTES)
                if not data:
                    break
                body = not answers and not REQUEST_LINE.match(data)
                if not answers and not body:
                    request[0] = data[:REQUEST_LINE_BYTES].split(b"\r\n", 1)[0]
                await self._flowing(request, body)  # read before a stall: held, not forwarded
                step = self.trickle_bytes if answers and self.mode == "trickle" else len(data)
                for at in range(0, len(data), step):
                    if at:
                        await asyncio.sleep(self.trickle_s)
                        await self._flowing(request, body)
                    dst.write(data[at : at + step])
                    await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if dst.can_write_eof():
                with suppress(OSError):
                    dst.write_eof()

    def close(self) -> None:
        """Stop listening, drop every connection, end the loop's thread."""

        async def shut() -> None:
            self._server.close()
            for w in list(self._writers):
                w.close()
            async with self._switched:
                self.mode = "pass"
                self._switched.notify_all()

        self._run(shut())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
