"""Shard GETs on plain asyncio sockets: one request, one `Content-Length` body read with `recv_into`.

aiohttp turns every socket read into a fresh `bytes` object that passes through its parser, a stream
reader and an iterator before our code sees it. For bulk shard bodies that was the largest CPU cost
after the kernel's own copies (bench/shardcast.py, 8 clients on 2 cores). Here the body lands with
`sock_recv_into` in a buffer the caller reuses for every shard, so the bytes are copied once out of
the socket and once into the page cache, as in a bare TCP copy, and hashed while still in cache.

Only what a SHARDCAST server sends is accepted: `HTTP/1.x`, a status line, at most `MAX_HEADER_BYTES`
of headers and a body framed by `Content-Length`. Chunked or unframed bodies, malformed or oversized
headers, and a peer that goes silent for `read_timeout` seconds are a `SourceError`. Connections are
kept alive per source and reused only after a body was read to its exact end. Plain `http://` only:
integrity comes from the signed manifest and the per-shard hashes, not from the transport.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from shardcast.errors import SourceError, SourceTimeoutError

MAX_HEADER_BYTES = 16 * 1024
MAX_HEADERS = 64
_MAX_CONTENT_LENGTH = 1 << 44
_IDLE_PER_SOURCE = 16


def parse_source(url: str) -> tuple[str, int]:
    """(host, port) of an `http://host[:port]` source URL; `SourceError` for anything else."""
    try:
        parts = urlsplit(url)
        port = parts.port if parts.port is not None else 80
    except ValueError as exc:
        raise SourceError(f"bad source URL {url!r}: {exc}") from None
    if parts.scheme != "http" or not parts.hostname or port == 0:
        raise SourceError(
            f"bad source URL {url!r}: sources are plain http://host:port (shards are verified against the "
            "signed manifest, so the transport needs no TLS)"
        )
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise SourceError(f"bad source URL {url!r}: give only scheme, host and port")
    return parts.hostname, port


def _is_digits(text: str, most: int) -> bool:
    """ASCII digits only (str.isdigit also takes '²'), 1 to `most` of them."""
    return 0 < len(text) <= most and text.isascii() and text.isdigit()


class _ClosedEarly(SourceError):
    """The peer closed or reset the connection. Before any byte of a response, on a pooled keep-alive
    connection, that is the peer's idle timeout, not a fault: the pool sends the request again."""


@dataclass
class Response:
    """A parsed status line and headers; `prefix` holds body bytes that arrived with the headers."""

    status: int
    headers: dict[str, str]
    content_length: int | None
    keep_alive: bool
    prefix: bytes


def parse_head(head: bytes) -> tuple[int, dict[str, str], int | None, bool]:
    """Status, headers (lower-case names), Content-Length and keep-alive of a response head (no CRLFCRLF)."""
    lines = head.split(b"\r\n")
    status_line = lines[0].decode("latin-1")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or parts[0] not in ("HTTP/1.1", "HTTP/1.0") or not (len(parts[1]) == 3 and _is_digits(parts[1], 3)):
        raise SourceError(f"malformed status line {status_line[:80]!r}")
    if len(lines) - 1 > MAX_HEADERS:
        raise SourceError(f"more than {MAX_HEADERS} response headers")
    headers: dict[str, str] = {}
    for raw in lines[1:]:
        name, sep, value = raw.decode("latin-1").partition(":")
        if not sep or not name or name != name.strip() or any(c in name for c in " \t"):
            raise SourceError(f"malformed header line {raw[:80]!r}")
        key = name.lower()
        value = value.strip()
        if key == "content-length" and key in headers and headers[key] != value:
            raise SourceError("conflicting Content-Length headers")
        headers[key] = value
    if "transfer-encoding" in headers:
        raise SourceError(f"unsupported Transfer-Encoding {headers['transfer-encoding'][:40]!r}")
    length: int | None = None
    if "content-length" in headers:
        text = headers["content-length"]
        if not _is_digits(text, 15) or int(text) > _MAX_CONTENT_LENGTH:
            raise SourceError(f"bad Content-Length {text[:40]!r}")
        length = int(text)
    connection = headers.get("connection", "").lower()
    keep_alive = parts[0] == "HTTP/1.1" and "close" not in connection
    return int(parts[1]), headers, length, keep_alive


class Connection:
    """One keep-alive socket to a source; `reusable` turns true only after a body ended exactly."""

    def __init__(self, sock: socket.socket, source: tuple[str, int], read_timeout: float) -> None:
        self.sock = sock
        self.source = source
        self.read_timeout = read_timeout
        self.reusable = False
        self._loop = asyncio.get_running_loop()

    async def recv_into(self, view: memoryview) -> int:
        """Up to len(view) bytes; 0 at end of stream; `SourceError` after `read_timeout` s of silence.

        Bytes already waiting in the socket are taken without touching the event loop (no future, no
        timer): during a bulk transfer that is most calls, and each object spared is garbage not made.
        """
        try:
            return self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            pass
        except ConnectionResetError:
            raise _ClosedEarly(f"{self.source[0]}:{self.source[1]} reset the connection") from None
        except OSError as exc:
            raise SourceError(f"{self.source[0]}:{self.source[1]}: {exc.__class__.__name__}: {exc}") from None
        try:
            async with asyncio.timeout(self.read_timeout):
                return await self._loop.sock_recv_into(self.sock, view)
        except TimeoutError:
            raise SourceTimeoutError(f"no bytes from {self.source[0]}:{self.source[1]} for {self.read_timeout:g} s") from None
        except ConnectionResetError:
            raise _ClosedEarly(f"{self.source[0]}:{self.source[1]} reset the connection") from None
        except OSError as exc:
            raise SourceError(f"{self.source[0]}:{self.source[1]}: {exc.__class__.__name__}: {exc}") from None

    async def request(self, path: str, headers: dict[str, str]) -> Response:
        """Send a GET for `path` and read the response head."""
        host, port = self.source
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        lines = [f"GET {path} HTTP/1.1", f"Host: {authority}", "Accept-Encoding: identity",
                 "User-Agent: prime-shardcast"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        try:
            async with asyncio.timeout(self.read_timeout):
                await self._loop.sock_sendall(self.sock, data)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _ClosedEarly(f"{host}:{port}: sending the request: {exc.__class__.__name__}") from None
        except (OSError, TimeoutError) as exc:
            raise SourceError(f"{host}:{port}: sending the request: {exc.__class__.__name__}: {exc}") from None
        buffer = bytearray(MAX_HEADER_BYTES + 1)
        view = memoryview(buffer)
        filled = 0
        try:
            # The whole head within `read_timeout` (a relay may hold a request while the shard arrives,
            # 30 s by default), not just each read: a peer dripping a byte at a time cannot stretch it.
            async with asyncio.timeout(self.read_timeout):
                while True:
                    n = await self.recv_into(view[filled:])
                    if n == 0:
                        cls = _ClosedEarly if filled == 0 else SourceError
                        raise cls(f"{host}:{port} closed the connection before a response")
                    filled += n
                    end = buffer.find(b"\r\n\r\n", max(0, filled - n - 3), filled)
                    if end >= 0:
                        break
                    if filled > MAX_HEADER_BYTES:
                        raise SourceError(f"{host}:{port} sent more than {MAX_HEADER_BYTES} bytes of headers")
        except TimeoutError:
            raise SourceTimeoutError(f"{host}:{port} sent no complete response head in {self.read_timeout:g} s") from None
        status, parsed, length, keep_alive = parse_head(bytes(buffer[:end]))
        return Response(status, parsed, length, keep_alive, bytes(buffer[end + 4 : filled]))

    def close(self) -> None:
        self.reusable = False
        self.sock.close()


class ConnectionPool:
    """Keep-alive connections to a set of sources (one Downloader's worth)."""

    def __init__(self, *, connect_timeout: float = 10.0, read_timeout: float = 90.0) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._idle: dict[tuple[str, int], list[Connection]] = {}

    async def _connect(self, source: tuple[str, int]) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                infos = await loop.getaddrinfo(source[0], source[1], type=socket.SOCK_STREAM)
                last: OSError | None = None
                for family, kind, proto, _, address in infos:
                    sock = socket.socket(family, kind, proto)
                    sock.setblocking(False)
                    try:
                        await loop.sock_connect(sock, address)
                    except OSError as exc:
                        sock.close()
                        last = exc
                        continue
                    except BaseException:
                        sock.close()
                        raise
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    return Connection(sock, source, self.read_timeout)
                raise last or OSError("no address")
        except TimeoutError:
            raise SourceTimeoutError(f"connecting to {source[0]}:{source[1]} timed out") from None
        except OSError as exc:
            raise SourceError(f"connecting to {source[0]}:{source[1]}: {exc.__class__.__name__}: {exc}") from None

    async def request(self, url: str, path: str, headers: dict[str, str]) -> tuple[Connection, Response]:
        """GET `path` from `url`'s source; the caller reads the body and hands the connection to `release`.

        A pooled connection the peer has meanwhile closed (or reset) fails before any response byte; it is
        dropped and the request goes out again on the next pooled or a fresh connection. Any other failure
        (timeout, malformed answer) is the source's and raised.
        """
        source = parse_source(url)
        idle = self._idle.setdefault(source, [])
        while idle:
            conn = idle.pop()
            try:
                return conn, await conn.request(path, headers)
            except _ClosedEarly:
                conn.close()
            except BaseException:
                conn.close()
                raise
        conn = await self._connect(source)
        try:
            return conn, await conn.request(path, headers)
        except BaseException:
            conn.close()
            raise

    def release(self, conn: Connection) -> None:
        """Keep `conn` for the next request if its last body ended exactly, else close it."""
        idle = self._idle.setdefault(conn.source, [])
        if conn.reusable and len(idle) < _IDLE_PER_SOURCE:
            conn.reusable = False
            idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
