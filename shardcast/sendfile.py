"""Shard responses whose bytes go out by `os.sendfile` on a worker thread.

aiohttp's FileResponse runs sendfile on the event loop's thread, so a relay serving many clients is
bound to one core, and the same thread must also receive the shards it is relaying. Here the
headers go through aiohttp as usual; then, with the transport's buffer empty and reading paused
(public transport API), a worker thread pushes the body with sendfile (the kernel copies from the
page cache; the thread waits for socket space with poll, so no Python touches the bytes), and the
loop stays free. Range requests (a single range) get 206; unsatisfiable ones 416.
"""

from __future__ import annotations

import asyncio
import os
import re
import select
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_POLL_MS = 30_000  # a client that accepts no bytes for 30 s is dropped


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


def _push(sock_fd: int, file_fd: int, offset: int, count: int) -> None:
    """Send on the calling (worker) thread; closes both descriptors, which are the thread's own dups."""
    try:
        _push_all(sock_fd, file_fd, offset, count)
    finally:
        os.close(sock_fd)
        os.close(file_fd)


def _push_all(sock_fd: int, file_fd: int, offset: int, count: int) -> None:
    poller = select.poll()
    poller.register(sock_fd, select.POLLOUT)
    while count > 0:
        try:
            sent = os.sendfile(sock_fd, file_fd, offset, count)
        except BlockingIOError:
            sent = 0
        if sent == 0:
            events = poller.poll(_POLL_MS)
            if not events:
                raise TimeoutError("client accepted no bytes for 30 s")
            if events[0][1] & (select.POLLERR | select.POLLHUP):
                raise ConnectionResetError("client went away")
            continue
        offset += sent
        count -= sent


async def send_file(
    request: web.Request, path: Path, pool: ThreadPoolExecutor, *, extra_headers: dict[str, str] | None = None
) -> web.StreamResponse:
    """Answer `request` with the bytes of `path` (GET or HEAD, Range aware); 404 if it vanished."""
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
            return response
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if transport is None or sock is None:
            raise ConnectionResetError("connection closed before the body")
        while transport.get_write_buffer_size() > 0:  # the headers must be out before the body
            if transport.is_closing():
                raise ConnectionResetError("connection closed before the body")
            await asyncio.sleep(0.001)
        transport.pause_reading()
        # The thread works on its own duplicates and closes them itself: if the transport closes its
        # socket or this coroutine is cancelled meanwhile, no descriptor number can be reused under
        # the thread's feet.
        sock_fd, file_fd = os.dup(sock.fileno()), os.dup(fd)
        try:
            await asyncio.get_running_loop().run_in_executor(pool, _push, sock_fd, file_fd, start, end - start)
        finally:
            if not transport.is_closing():
                transport.resume_reading()
        await response.write_eof()
        return response
    finally:
        os.close(fd)
