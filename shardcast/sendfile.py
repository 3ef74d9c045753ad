"""Shard responses whose bytes go out by `os.sendfile` on worker threads, with a floor on the send rate.

aiohttp's FileResponse runs sendfile on the event loop's thread, so a relay serving many clients is
bound to one core, and the same thread must also receive the shards it is relaying. Here the
headers go through aiohttp as usual; then, with the transport's buffer empty and reading paused
(public transport API), a worker thread pushes the body with sendfile (the kernel copies from the
page cache; the thread waits for socket space with poll, so no Python touches the bytes), and the
loop stays free. Range requests (a single range) get 206; unsatisfiable ones 416.

A client that stops reading must not hold a worker thread: the pool is small (16 by default), and
16 such clients used to stall every honest transfer behind them for the 30 s a thread waited. A
thread now waits at most `PARK_S` for socket space; then it returns and the event loop watches the
socket (no thread held) until there is room again. Every response must also keep up an average
rate (`SendFloor`: after a grace period, at least `min_rate` bytes/s since its first byte); one that
falls below is cut (the connection is aborted), so a slow or stalled reader holds a transfer slot
and a connection for a bounded time, and never a thread for longer than `PARK_S`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import select
import socket
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

log = logging.getLogger(__name__)

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
PARK_S = 0.25
"""How long a worker thread waits for socket space before handing the wait to the event loop."""


@dataclass(frozen=True)
class SendFloor:
    """The slowest a response body may go: after `grace_s`, at least `min_rate` bytes/s on average."""

    min_rate: float = 16 * 1024
    grace_s: float = 20.0

    def budget(self, sent: int, elapsed: float) -> float:
        """Seconds the response may still wait for the client to make room before it falls below the floor."""
        return max(self.grace_s, sent / self.min_rate) - elapsed


class SlowReader(Exception):
    """A client read a response body slower than the floor allows (internal: the connection is cut)."""


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end exclusive) of a single `bytes=` range; None to send everything; ValueError if unsatisfiable.

    Several ranges, or another unit, are ignored (RFC 9110 allows serving the whole representation).
    """
    if not header:
        return None
    match = _RANGE.match(header.strip())
    if match is None:
        return None
    first, last = match.groups()
    if not first and not last:
        raise ValueError("empty range")
    if not first:  # suffix: the last N bytes
        n = int(last)
        if n == 0:
            raise ValueError("empty suffix range")
        return max(0, size - n), size
    start = int(first)
    end = min(size, int(last) + 1) if last else size
    if start >= size or end <= start:
        raise ValueError("range outside the shard")
    return start, end


def _push_some(sock_fd: int, file_fd: int, offset: int, count: int, park_s: float) -> int:
    """Send up to `count` bytes on the calling (worker) thread; the number sent.

    Returns early, with what it sent, once the socket has had no room for `park_s` seconds: the
    caller waits for room without holding the thread. Raises `ConnectionResetError` if the client
    went away.
    """
    poller = select.poll()
    poller.register(sock_fd, select.POLLOUT)
    total = 0
    while total < count:
        try:
            sent = os.sendfile(sock_fd, file_fd, offset + total, count - total)
        except BlockingIOError:
            events = poller.poll(int(park_s * 1000))
            if not events:
                return total
            if events[0][1] & (select.POLLERR | select.POLLHUP):
                raise ConnectionResetError("client went away") from None
            continue
        if sent == 0:  # end of file before `count` bytes (a non-blocking socket that is full raises instead)
            raise ConnectionAbortedError("shard file ended early")
        total += sent
    return total


async def _writable(loop: asyncio.AbstractEventLoop, fd: int, timeout: float) -> bool:
    """Wait (on the loop, no thread) until `fd` has room to send; False after `timeout` seconds."""
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(fd, wake)
    try:
        async with asyncio.timeout(timeout):
            await ready
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_writer(fd)


async def _send_body(sock: socket.socket, fd: int, start: int, count: int, pool: ThreadPoolExecutor,
                     floor: SendFloor) -> int:
    """Push `count` bytes of `fd` from `start` into `sock`; the bytes sent. `SlowReader` below the floor.

    Threads work on this call's own duplicates of both descriptors. They are closed only when no
    thread uses them any more: if the transport closes its socket or this coroutine is cancelled
    while a thread is sending, no descriptor number can be reused under the thread's feet.
    """
    loop = asyncio.get_running_loop()
    sock_fd, file_fd = os.dup(sock.fileno()), os.dup(fd)

    def close_both(_: object = None) -> None:
        os.close(sock_fd)
        os.close(file_fd)

    running: Future[int] | None = None
    began = loop.time()
    sent = 0
    try:
        while sent < count:
            running = pool.submit(_push_some, sock_fd, file_fd, start + sent, count - sent, PARK_S)
            sent += await asyncio.wrap_future(running)
            running = None
            if sent == count:
                break
            # The client makes no room: wait for it here, on the loop, as long as the floor allows.
            budget = floor.budget(sent, loop.time() - began)
            if budget <= 0 or not await _writable(loop, sock_fd, budget):
                raise SlowReader(f"{sent} of {count} bytes in {loop.time() - began:.1f} s")
        return sent
    finally:
        if running is not None and not running.done():
            running.add_done_callback(close_both)  # the thread returns within PARK_S
        else:
            close_both()


async def _headers_flushed(transport: asyncio.Transport, floor: SendFloor) -> None:
    """Wait until the transport's buffer (the response head) is in the kernel; `SlowReader` past the grace."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + floor.grace_s
    pause = 0.001
    while transport.get_write_buffer_size() > 0:
        if transport.is_closing():
            raise ConnectionResetError("connection closed before the body")
        if loop.time() > deadline:
            raise SlowReader("the response head did not leave")
        await asyncio.sleep(pause)
        pause = min(0.05, pause * 2)


@dataclass
class Sent:
    """What `send_file` did: the response, the body bytes that left, and whether a slow reader was cut off."""

    response: web.StreamResponse
    body_bytes: int = 0
    cut_slow: bool = False


async def send_file(
    request: web.Request, path: Path, pool: ThreadPoolExecutor, *, floor: SendFloor | None = None,
    extra_headers: dict[str, str] | None = None,
) -> Sent:
    """Answer `request` with the bytes of `path` (GET or HEAD, Range aware); 404 if it vanished.

    A client reading below `floor`, or one that goes away mid-body, has its connection aborted; the
    response is still returned (aiohttp then ends the exchange without logging an error).
    """
    floor = floor or SendFloor()
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as exc:  # dropped by retention since the handler looked
        raise web.HTTPNotFound(text="shard dropped") from exc
    try:
        size = os.fstat(fd).st_size
        try:
            span = parse_range(request.headers.get("Range"), size)
        except ValueError as exc:
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"}) from exc
        start, end = span if span is not None else (0, size)
        response = web.StreamResponse(status=206 if span is not None else 200)
        response.headers.update(extra_headers or {})
        response.headers["Accept-Ranges"] = "bytes"
        response.headers["Content-Type"] = "application/octet-stream"
        if span is not None:
            response.headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        response.content_length = end - start
        writer = await response.prepare(request)
        send_headers = getattr(writer, "send_headers", None)
        if send_headers is not None:
            send_headers()  # make sure aiohttp is not holding them back to coalesce with a body
        if request.method == "HEAD" or end == start:
            await response.write_eof()
            return Sent(response)
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if transport is None or sock is None:
            raise ConnectionResetError("connection closed before the body")
        try:
            await _headers_flushed(transport, floor)  # the head must be out before the body
            transport.pause_reading()
            sent = await _send_body(sock, fd, start, end - start, pool, floor)
        except SlowReader as exc:
            log.info("cutting off %s: reading slower than %.0f B/s (%s)", request.remote, floor.min_rate, exc)
            # Reset rather than close: a plain close would leave the kernel holding the unsent bytes
            # (megabytes) against the reader's zero window for minutes.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
            return Sent(response, cut_slow=True)
        except OSError as exc:
            log.debug("%s went away mid-body: %s", request.remote, exc)
            transport.abort()
            return Sent(response)
        finally:
            if not transport.is_closing():
                transport.resume_reading()
        await response.write_eof()
        return Sent(response, sent)
    finally:
        os.close(fd)
