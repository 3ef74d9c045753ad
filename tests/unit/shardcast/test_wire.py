"""The shard-body HTTP/1.1 client (shardcast.wire) and the Downloader on top of it, against scripted
loopback servers that write raw response bytes."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import blake3
import pytest

from protocol.errors import RelayError
from shardcast.errors import SourceError, StorageError
from shardcast.manifest import Manifest, ShardEntry, now_ms
from shardcast.sources import SourceBoard
from shardcast.transfer import Downloader
from shardcast.wire import MAX_HEADER_BYTES, MAX_HEADERS, Connection, ConnectionPool, parse_head, parse_source

T = TypeVar("T")
Script = Callable[["Scripted", int, bytes, asyncio.StreamWriter], Awaitable[bool]]


def run(coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
    """Run an async test body with a hard timeout (a hang fails instead of blocking the suite)."""
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def response(status: int, body: bytes = b"", *, length: int | None = None, extra: str = "",
             version: str = "HTTP/1.1") -> bytes:
    """Raw response bytes; `length` overrides the announced Content-Length (-1: none)."""
    announced = len(body) if length is None else length
    head = f"{version} {status} X\r\n" + (f"Content-Length: {announced}\r\n" if announced >= 0 else "") + extra
    return head.encode() + b"\r\n" + body


def header(request: bytes, name: str) -> str | None:
    for line in request.decode("latin-1").split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


class Scripted:
    """A loopback peer: reads request heads and lets `script(server, conn_no, head, writer)` answer;
    the connection stays open while the script returns True."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[tuple[int, bytes]] = []
        self.ended: asyncio.Queue[int] = asyncio.Queue()
        self.stop = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def paths(self) -> list[str]:
        return [head.split(b" ")[1].decode() for _, head in self.requests]

    async def __aenter__(self) -> Scripted:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._handlers:  # let them see EOF and end (asyncio.run cancelling them logs noise on 3.11)
            await asyncio.wait(self._handlers, timeout=5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn_no = self.connections
        self._writers.add(writer)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append((conn_no, head))
                if not await self.script(self, conn_no, head, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except ConnectionError:
                pass
            self._writers.discard(writer)
            self.ended.put_nowait(conn_no)


def answer(raw: bytes, *, keep: bool = True) -> Script:
    async def script(server: Scripted, conn_no: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(raw)
        await writer.drain()
        return keep
    return script


async def read_body(conn: Connection, length: int, prefix: bytes) -> bytes:
    data = bytearray(prefix)
    buffer = memoryview(bytearray(65536))
    while len(data) < length:
        n = await conn.recv_into(buffer[: min(len(buffer), length - len(data))])
        assert n > 0, "peer closed early"
        data += buffer[:n]
    return bytes(data)


# -- parse_source ----------------------------------------------------------------------------------


def test_parse_source_accepts_plain_http_host_port() -> None:
    assert parse_source("http://127.0.0.1:8123") == ("127.0.0.1", 8123)
    assert parse_source("http://127.0.0.1:8123/") == ("127.0.0.1", 8123)  # a bare trailing slash is no path
    assert parse_source("http://relay.example") == ("relay.example", 80)


@pytest.mark.parametrize("url", [
    "https://127.0.0.1:8123", "ftp://127.0.0.1:8123", "127.0.0.1:8123", "http://", "http://:8123",
    "http://127.0.0.1:8123/v/3", "http://127.0.0.1:8123?x=1", "http://127.0.0.1:8123/#frag",
    "http://127.0.0.1:port", "http://127.0.0.1:99999", "http://127.0.0.1:-1",
])
def test_parse_source_rejects_anything_else(url: str) -> None:
    with pytest.raises(SourceError):
        parse_source(url)


# -- parse_head ------------------------------------------------------------------------------------


def test_parse_head_good_heads() -> None:
    status, headers, length, keep_alive = parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nX-Thing:  a b ")
    assert (status, length, keep_alive) == (200, 12, True)
    assert headers == {"content-length": "12", "x-thing": "a b"}
    status, headers, length, keep_alive = parse_head(
        b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 5-9/10\r\ncontent-length: 5\r\nContent-Length: 5"
    )
    assert (status, length, keep_alive) == (206, 5, True)  # an identical duplicate is harmless
    assert parse_head(b"HTTP/1.1 404") == (404, {}, None, True)  # no reason phrase, no headers


def test_parse_head_connection_close_and_http10_are_not_kept_alive() -> None:
    assert parse_head(b"HTTP/1.1 200 OK\r\nConnection: Close\r\nContent-Length: 0")[3] is False
    assert parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 0")[3] is False
    assert parse_head(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0")[3] is False
    assert parse_head(b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0")[3] is True


@pytest.mark.parametrize("head", [
    b"", b"HTTP/1.1", b"HTTP/1.1200 OK", b"garbage", b"HTTP/2 200 OK", b"HTTP/2.0 200 OK", b"http/1.1 200 OK",
    b"ICY 200 OK", b"HTTP/1.1 2x0 OK", b"HTTP/1.1 20 OK", b"HTTP/1.1 2000 OK", b"HTTP/1.1  200 OK",
])
def test_parse_head_rejects_malformed_status_lines(head: bytes) -> None:
    with pytest.raises(SourceError):
        parse_head(head + b"\r\nContent-Length: 0")


@pytest.mark.parametrize("lines", [
    [b"Transfer-Encoding: chunked"],
    [b"Content-Length: 10", b"Transfer-Encoding: chunked"],
    [b"Content-Length: 10", b"Content-Length: 11"],
    [b"Content-Length: ten"], [b"Content-Length: -1"], [b"Content-Length: +5"], [b"Content-Length: 1e3"],
    [b"Content-Length: "], [b"Content-Length: 5 5"], [b"Content-Length: 99999999999999999999"],
    [f"Content-Length: {(1 << 44) + 1}".encode()],
    [b"no colon here"], [b": empty name"], [b" Content-Length: 5"], [b"Content-Length : 5"], [b"X Y: z"],
    [b"Content-Length: 5", b""],
])
def test_parse_head_rejects_bad_headers(lines: list[bytes]) -> None:
    with pytest.raises(SourceError):
        parse_head(b"\r\n".join([b"HTTP/1.1 200 OK", *lines]))


@pytest.mark.parametrize("head", [b"HTTP/1.1 200 OK\r\nContent-Length: \xb2", b"HTTP/1.1 20\xb2 OK"])
def test_parse_head_superscript_digits_are_a_source_error(head: bytes) -> None:
    with pytest.raises(SourceError):
        parse_head(head)


def test_parse_head_header_count_limit() -> None:
    lines = [f"X-H{i}: v".encode() for i in range(MAX_HEADERS - 1)] + [b"Content-Length: 0"]
    assert parse_head(b"\r\n".join([b"HTTP/1.1 200 OK", *lines]))[2] == 0
    with pytest.raises(SourceError, match="headers"):
        parse_head(b"\r\n".join([b"HTTP/1.1 200 OK", *lines, b"X-One-Too-Many: v"]))


# -- ConnectionPool against scripted servers -------------------------------------------------------


def test_request_sends_get_and_splits_prefix_from_rest_of_body() -> None:
    body = bytes(range(256)) * 40
    first, rest = body[:1000], body[1000:]
    go_on = asyncio.Event()

    async def script(server: Scripted, conn_no: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(response(200, first, length=len(body)))  # head and the first body bytes in one send
        await writer.drain()
        await go_on.wait()
        writer.write(rest)
        await writer.drain()
        return True

    async def body_() -> None:
        async with Scripted(script) as server:
            pool = ConnectionPool()
            conn, resp = await pool.request(server.url + "/", "/v/3/shards/7", {"Range": "bytes=0-"})
            assert (resp.status, resp.content_length, resp.keep_alive) == (200, len(body), True)
            assert resp.prefix == first
            go_on.set()
            assert await read_body(conn, len(body), resp.prefix) == body
            pool.release(conn)
            pool.close()
            [(_, head)] = server.requests
            assert head.startswith(b"GET /v/3/shards/7 HTTP/1.1\r\n")
            assert header(head, "Host") == f"127.0.0.1:{server.port}"
            assert header(head, "Range") == "bytes=0-"
            assert header(head, "Accept-Encoding") == "identity"

    run(body_())


def test_oversized_headers_are_a_source_error() -> None:
    raw = b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * (MAX_HEADER_BYTES + 100) + b"\r\nContent-Length: 0\r\n\r\n"

    async def body_() -> None:
        async with Scripted(answer(raw)) as server:
            pool = ConnectionPool()
            with pytest.raises(SourceError, match="bytes of headers"):
                await pool.request(server.url, "/x", {})
            pool.close()

    run(body_())


def test_server_closing_before_a_response_is_a_source_error() -> None:
    async def body_() -> None:
        async with Scripted(answer(b"", keep=False)) as server:
            pool = ConnectionPool()
            with pytest.raises(SourceError, match="closed the connection"):
                await pool.request(server.url, "/x", {})
            pool.close()

    run(body_())


def test_silent_server_is_a_source_error_after_read_timeout() -> None:
    async def silent(server: Scripted, conn_no: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        await server.stop.wait()
        return False

    async def body_() -> None:
        async with Scripted(silent) as server:
            pool = ConnectionPool(read_timeout=0.3)
            with pytest.raises(SourceError, match="no bytes|no complete response head"):
                await pool.request(server.url, "/x", {})
            pool.close()

    run(body_())


def test_silent_server_mid_body_is_a_source_error() -> None:
    async def stall(server: Scripted, conn_no: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(response(200, b"abc", length=10))
        await writer.drain()
        await server.stop.wait()
        return False

    async def body_() -> None:
        async with Scripted(stall) as server:
            pool = ConnectionPool(read_timeout=0.3)
            conn, resp = await pool.request(server.url, "/x", {})
            assert resp.prefix == b"abc"
            with pytest.raises(SourceError, match="no bytes|no complete response head"):
                await read_body(conn, 10, resp.prefix)
            pool.release(conn)
            pool.close()

    run(body_())


def test_connection_refused_is_a_source_error() -> None:
    async def body_() -> None:
        with socket.socket() as bound:  # bound but not listening: connecting is refused, and nobody can take the port
            bound.bind(("127.0.0.1", 0))
            port = bound.getsockname()[1]
            pool = ConnectionPool(connect_timeout=5)
            with pytest.raises(SourceError, match="connecting"):
                await pool.request(f"http://127.0.0.1:{port}", "/x", {})

    run(body_())


def test_malformed_response_through_the_pool_is_a_source_error() -> None:
    async def body_() -> None:
        async with Scripted(answer(response(200, b"xx", extra="Transfer-Encoding: chunked\r\n"))) as server:
            pool = ConnectionPool()
            with pytest.raises(SourceError, match="Transfer-Encoding"):
                await pool.request(server.url, "/x", {})
            pool.close()

    run(body_())


def test_keep_alive_reuses_the_socket_after_an_exact_body() -> None:
    async def body_() -> None:
        async with Scripted(answer(response(200, b"hello"))) as server:
            pool = ConnectionPool()
            conns = []
            for _ in range(2):
                conn, resp = await pool.request(server.url, "/x", {})
                assert await read_body(conn, 5, resp.prefix) == b"hello"
                conn.reusable = True
                pool.release(conn)
                conns.append(conn)
            pool.close()
            assert conns[0] is conns[1]
            assert server.connections == 1 and [c for c, _ in server.requests] == [1, 1]

    run(body_())


def test_connection_not_marked_reusable_is_closed_on_release() -> None:
    async def body_() -> None:
        async with Scripted(answer(response(200, b"hello"))) as server:
            pool = ConnectionPool()
            for _ in range(2):
                conn, resp = await pool.request(server.url, "/x", {})
                assert await read_body(conn, 5, resp.prefix) == b"hello"
                pool.release(conn)  # reusable stays False
            pool.close()
            assert server.connections == 2

    run(body_())


def test_pooled_connection_closed_by_the_peer_is_replaced() -> None:
    async def body_() -> None:
        async with Scripted(answer(response(200, b"hello"), keep=False)) as server:
            pool = ConnectionPool()
            conn, resp = await pool.request(server.url, "/x", {})
            assert await read_body(conn, 5, resp.prefix) == b"hello"
            conn.reusable = True
            pool.release(conn)
            assert await asyncio.wait_for(server.ended.get(), 5) == 1  # the server has closed its end
            conn2, resp2 = await pool.request(server.url, "/y", {})
            assert await read_body(conn2, 5, resp2.prefix) == b"hello"
            assert conn2 is not conn
            pool.release(conn2)
            pool.close()
            assert server.connections == 2
            assert [c for c, _ in server.requests] == [1, 2]  # the dead socket never reached the server

    run(body_())


# -- Downloader over the wire ----------------------------------------------------------------------


def make_manifest(data: bytes, shard_size: int) -> Manifest:
    shards = tuple(
        ShardEntry(index=i, file=0, offset=off, size=len(data[off : off + shard_size]),
                   hash=blake3.blake3(data[off : off + shard_size]).hexdigest())
        for i, off in enumerate(range(0, len(data), shard_size))
    )
    return Manifest(run_id="run-a", version=3, created_at_ms=now_ms(), shard_size=shard_size,
                    files=({"path": "w.bin", "size": len(data)},), shards=shards)


class FileSink:
    """Writes every shard into one file at its offset; records what the Downloader told it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self.committed: list[int] = []
        self.discarded: list[int] = []

    def open(self, shard: ShardEntry) -> tuple[int, int]:
        return self.fd, shard.offset

    def commit(self, shard: ShardEntry, fd: int) -> None:
        self.committed.append(shard.index)

    def discard(self, shard: ShardEntry, fd: int) -> None:
        self.discarded.append(shard.index)

    def close(self) -> None:
        os.close(self.fd)


def shard_server(data: bytes, manifest: Manifest, *, cut: int | None = None, bad_length: bool = False,
                 corrupt: bool = False, junk: bytes = b"", keep: bool = True, extra: str = "",
                 version: str = "HTTP/1.1") -> Script:
    """Serves `/v/3/shards/N` (200, or 206 for `Range: bytes=K-`) from `data`, with optional faults:
    `cut` (send that many body bytes then close), `bad_length` (announce one byte too many),
    `corrupt` (flip the body's first byte), `junk` (bytes after the body)."""
    async def script(server: Scripted, conn_no: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        shard = manifest.shards[int(head.split(b" ")[1].decode().rsplit("/", 1)[1])]
        body = data[shard.offset : shard.offset + shard.size]
        ranged = header(head, "Range")
        status = 200
        if ranged is not None:
            start = int(ranged.removeprefix("bytes=").rstrip("-"))
            body, status = body[start:], 206
        length = len(body) + (1 if bad_length else 0)
        if corrupt:
            body = bytes([body[0] ^ 1]) + body[1:]
        if cut is not None:
            writer.write(response(status, body[:cut], length=length))
            await writer.drain()
            return False
        writer.write(response(status, body, length=length, extra=extra, version=version) + junk)
        await writer.drain()
        return keep
    return script


def first_then(first: Script, later: Script) -> Script:
    """`first` answers the server's first request, `later` every other one."""
    async def script(server: Scripted, conn_no: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        return await (first if len(server.requests) == 1 else later)(server, conn_no, head, writer)
    return script


def pull(path: Path, manifest: Manifest, urls: list[str], **kwargs: Any) -> tuple[Downloader, FileSink]:
    board = SourceBoard(urls)
    sink = FileSink(path)
    return Downloader(board, manifest, sink, **kwargs), sink


def test_downloader_fetches_and_verifies_over_keep_alive(tmp_path: Path) -> None:
    data = random.Random(1).randbytes(1_300_000 + 1_000_001)  # shards span several 512 KiB receive batches
    manifest = make_manifest(data, 1_300_000)

    async def body_() -> None:
        async with Scripted(shard_server(data, manifest)) as server:
            downloader, sink = pull(tmp_path / "w.bin", manifest, [server.url + "/"], concurrency=1)
            seen: list[int] = []
            downloader.on_bytes = seen.append
            await downloader.run([0, 1])
            sink.close()
            assert sink.path.read_bytes() == data
            assert sorted(sink.committed) == [0, 1] and sink.discarded == []
            assert downloader.stats.shards_fetched == 2 and downloader.stats.bytes_fetched == len(data)
            assert sum(seen) == len(data) and downloader.stats.range_resumes == 0
            assert server.paths() == ["/v/3/shards/0", "/v/3/shards/1"]
            assert server.connections == 1  # the second shard reused the first one's socket

    run(body_())


def test_downloader_does_not_reuse_a_connection_with_bytes_past_the_body(tmp_path: Path) -> None:
    data = random.Random(2).randbytes(2000)
    manifest = make_manifest(data, 1000)

    async def body_() -> None:
        async with Scripted(shard_server(data, manifest, junk=b"JUNK")) as server:
            downloader, sink = pull(tmp_path / "w.bin", manifest, [server.url], concurrency=1)
            await downloader.run([0, 1])
            sink.close()
            assert sink.path.read_bytes() == data
            # Reusing the socket would have read "JUNK" as the next status line and needed a third request.
            assert server.connections == 2 and len(server.requests) == 2

    run(body_())


@pytest.mark.parametrize("close", [{"extra": "Connection: close\r\n"}, {"version": "HTTP/1.0"}])
def test_downloader_does_not_reuse_a_connection_the_server_closes(tmp_path: Path, close: dict[str, Any]) -> None:
    data = random.Random(2).randbytes(2000)
    manifest = make_manifest(data, 1000)

    async def body_() -> None:
        # The server keeps its end open regardless: only the client's reading of the head stops reuse.
        async with Scripted(shard_server(data, manifest, **close)) as server:
            downloader, sink = pull(tmp_path / "w.bin", manifest, [server.url], concurrency=1)
            await downloader.run([0, 1])
            sink.close()
            assert sink.path.read_bytes() == data
            assert server.connections == 2 and len(server.requests) == 2

    run(body_())


def test_wrong_content_length_from_the_only_contributor_bans_it(tmp_path: Path) -> None:
    data = random.Random(3).randbytes(50_000)
    manifest = make_manifest(data, 50_000)

    async def body_() -> None:
        async with Scripted(shard_server(data, manifest, bad_length=True)) as server:
            downloader, sink = pull(tmp_path / "w.bin", manifest, [server.url])
            with pytest.raises(RelayError, match="every source is banned"):
                await downloader.run([0])
            sink.close()
            source = downloader.board.sources[server.url]
            assert source.banned and "announced 50001 bytes" in (source.ban_reason or "")
            assert downloader.stats.hash_failures == 1
            assert sink.committed == [] and sink.discarded == [0]

    run(body_())


def test_bad_source_is_banned_and_another_completes(tmp_path: Path) -> None:
    data = random.Random(4).randbytes(300_000)
    manifest = make_manifest(data, 300_000)

    async def body_() -> None:
        faults: list[dict[str, Any]] = [{"bad_length": True}, {"corrupt": True}]
        for fault in faults:
            async with Scripted(shard_server(data, manifest, **fault)) as bad, \
                    Scripted(shard_server(data, manifest)) as good:
                downloader, sink = pull(tmp_path / f"{next(iter(fault))}.bin", manifest, [bad.url, good.url])
                await downloader.run([0])
                sink.close()
                assert sink.path.read_bytes() == data, fault
                assert downloader.board.sources[bad.url].banned, fault
                assert not downloader.board.sources[good.url].banned
                assert downloader.stats.hash_failures == 1 and sink.committed == [0]
                assert len(bad.requests) == 1 and len(good.requests) == 1

    run(body_())


def test_body_cut_short_resumes_with_range_from_another_source(tmp_path: Path) -> None:
    data = random.Random(5).randbytes(1_200_000)
    manifest = make_manifest(data, 1_200_000)
    cut = 700_001  # past one 512 KiB receive batch, so both the batch flush and the final flush count

    async def body_() -> None:
        async with Scripted(shard_server(data, manifest, cut=cut)) as first, \
                Scripted(shard_server(data, manifest)) as second:
            downloader, sink = pull(tmp_path / "w.bin", manifest, [first.url, second.url])
            await downloader.run([0])
            sink.close()
            assert sink.path.read_bytes() == data
            assert downloader.stats.range_resumes == 1 and downloader.stats.hash_failures == 0
            assert downloader.stats.bytes_fetched == len(data)
            [(_, head)] = second.requests
            assert header(head, "Range") == f"bytes={cut}-"
            assert header(first.requests[0][1], "Range") is None
            a, b = downloader.board.sources[first.url], downloader.board.sources[second.url]
            assert (a.failures, a.ok, a.banned) == (1, 0, False)
            assert (b.ok, b.bytes) == (1, len(data) - cut)

    run(body_())


def test_bad_resume_is_blamed_on_nobody_and_refetched_whole(tmp_path: Path) -> None:
    data = random.Random(6).randbytes(200_000)
    manifest = make_manifest(data, 200_000)

    async def body_() -> None:
        async with Scripted(shard_server(data, manifest, cut=90_000)) as first, \
                Scripted(first_then(shard_server(data, manifest, bad_length=True),
                                   shard_server(data, manifest))) as second:
            downloader, sink = pull(tmp_path / "w.bin", manifest, [first.url, second.url])
            await downloader.run([0])
            sink.close()
            assert sink.path.read_bytes() == data
            assert not any(s.banned for s in downloader.board.sources.values())  # two contributors: no blame
            assert downloader.stats.range_resumes == 1 and downloader.stats.hash_failures == 1
            assert sink.discarded == [0] and sink.committed == [0]
            assert [header(h, "Range") for _, h in second.requests] == ["bytes=90000-", None]

    run(body_())


@pytest.mark.parametrize(("answer_bytes", "failures"), [
    (response(404, b"no such shard"), 0),  # not there (yet): soft, nobody is blamed
    (response(500, b"oops"), 1),
    (response(200, b"x" * 10_000, length=-1), 1),  # unframed body: a failure, not a ban
], ids=["404", "500", "no-content-length"])
def test_a_source_that_cannot_serve_fails_over_without_a_ban(tmp_path: Path, answer_bytes: bytes,
                                                             failures: int) -> None:
    data = random.Random(7).randbytes(10_000)
    manifest = make_manifest(data, 10_000)

    async def body_() -> None:
        async with Scripted(answer(answer_bytes, keep=False)) as bad, Scripted(shard_server(data, manifest)) as good:
            downloader, sink = pull(tmp_path / "w.bin", manifest, [bad.url, good.url])
            await downloader.run([0])
            sink.close()
            assert sink.path.read_bytes() == data
            a = downloader.board.sources[bad.url]
            assert (a.failures, a.ok, a.banned) == (failures, 0, False)
            assert downloader.board.sources[good.url].ok == 1
            assert len(bad.requests) == 1 and downloader.stats.hash_failures == 0

    run(body_())


def test_stalled_pooled_connection_is_not_retried() -> None:
    """Only a pooled connection the peer closed is replaced; one that goes silent is the source's fault."""
    async def body_() -> None:
        async def script(server: Scripted, conn_no: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
            if len(server.requests) == 1:
                writer.write(response(200, b"hello"))
                await writer.drain()
            return True  # the second request gets no answer at all

        async with Scripted(script) as server:
            pool = ConnectionPool(read_timeout=0.3)
            conn, resp = await pool.request(server.url, "/x", {})
            assert await read_body(conn, 5, resp.prefix) == b"hello"
            conn.reusable = True
            pool.release(conn)
            with pytest.raises(SourceError, match="no bytes|no complete response head"):
                await pool.request(server.url, "/y", {})
            pool.close()
            assert server.connections == 1 and len(server.requests) == 2

    run(body_())


@pytest.mark.parametrize("url", ["https://127.0.0.1:1", "http://127.0.0.1:1/relay", "127.0.0.1:1"])
def test_client_and_relay_refuse_bad_source_urls_at_construction(tmp_path: Path, url: str) -> None:
    from protocol.identity import Identity
    from shardcast import Client, Relay

    trainer = Identity.create().address
    with pytest.raises(SourceError, match="bad source URL"):
        Client(["http://127.0.0.1:1", url], trainer=trainer, out_dir=tmp_path / "c")
    with pytest.raises(SourceError, match="bad source URL"):
        Relay([url], trainer=trainer, store_root=tmp_path / "r")


def test_dripping_head_is_cut_off_by_the_total_deadline() -> None:
    """Each byte arrives within the read timeout, but the head as a whole must too."""
    async def body_() -> None:
        async def script(server: Scripted, conn_no: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 1000:
                writer.write(bytes([byte]))
                await writer.drain()
                try:
                    await asyncio.wait_for(server.stop.wait(), 0.05)
                    return False
                except TimeoutError:
                    pass
            return False

        async with Scripted(script) as server:
            pool = ConnectionPool(read_timeout=0.6)
            with pytest.raises(SourceError, match="no complete response head"):
                await pool.request(server.url, "/x", {})
            pool.close()

    run(body_())


def test_dripping_body_falls_below_the_rate_floor_and_resumes_elsewhere(tmp_path: Path) -> None:
    data = random.Random(10).randbytes(50_000)
    manifest = make_manifest(data, 50_000)

    async def body_() -> None:
        async def drip(server: Scripted, conn_no: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
            writer.write(response(200, data[:1000], length=len(data)))  # a fair start, then a byte now and then
            await writer.drain()
            for byte in data[1000:]:
                try:
                    await asyncio.wait_for(server.stop.wait(), 0.05)
                    return False
                except TimeoutError:
                    writer.write(bytes([byte]))
                    await writer.drain()
            return False

        async with Scripted(drip) as slow, Scripted(shard_server(data, manifest)) as good:
            downloader, sink = pull(tmp_path / "w.bin", manifest, [slow.url, good.url],
                                    min_rate=100_000, min_rate_grace_s=0.5)
            downloader.board.sources[good.url].cooldown_until = time.monotonic() + 0.2  # the slow one goes first
            await downloader.run([0])
            sink.close()
            assert sink.path.read_bytes() == data
            assert downloader.board.sources[slow.url].failures == 1
            assert not downloader.board.sources[slow.url].banned
            assert downloader.stats.range_resumes == 1

    run(body_())


class ReadOnlySink(FileSink):
    """A sink whose file refuses writes (as a full or read-only disk would): every pwrite fails."""

    def __init__(self, path: Path) -> None:
        path.write_bytes(b"")
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.committed, self.discarded = [], []


def test_a_disk_that_refuses_the_bytes_is_a_storage_error_naming_the_file(tmp_path: Path) -> None:
    data = random.Random(5).randbytes(300_000)
    manifest = make_manifest(data, 100_000)

    async def body_() -> None:
        async with Scripted(shard_server(data, manifest)) as server:
            sink = ReadOnlySink(tmp_path / "w.bin")
            downloader = Downloader(SourceBoard([server.url]), manifest, sink, concurrency=1)
            with pytest.raises(StorageError, match=r"w\.bin \(shard 0 of v3\)") as caught:
                await downloader.run([0, 1, 2])
            assert isinstance(caught.value, RelayError)
            assert not downloader.board.sources[server.url].banned  # the local disk is nobody's fault
            sink.close()

    run(body_())
