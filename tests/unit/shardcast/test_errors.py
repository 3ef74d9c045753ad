"""Every error SHARDCAST raises on purpose is a `RelayError` (root `PrimeError`): bad settings and a file
system that refuses are classified where they happen, not let through as `ValueError` or `OSError`."""

from __future__ import annotations

import ast
import asyncio
import builtins
import socket
from pathlib import Path

import pytest

from protocol.errors import ConfigError, PrimeError, RelayError
from protocol.identity import Identity
from shardcast import Client, Relay
from shardcast.errors import PublishError, RelayConfigError, StorageError
from shardcast.publisher import Publisher, publish_blocking
from shardcast.server import ServeLimits, ShardServer, peer_key
from shardcast.sources import SourceBoard
from shardcast.store import Store

PACKAGE = Path(__file__).resolve().parents[3] / "shardcast"
TRAINER = "0x" + "11" * 20


def _checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "w.bin").write_bytes(b"w" * 1000)
    return ckpt


def test_bad_settings_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(RelayConfigError, match="retention"):
        Store(tmp_path / "s", retention=0)
    with pytest.raises(RelayConfigError):
        Client([], trainer=TRAINER, out_dir=tmp_path / "o")
    with pytest.raises(RelayConfigError):
        Relay([], trainer=TRAINER, store_root=tmp_path / "r")
    with pytest.raises(RelayConfigError):
        SourceBoard([])
    with pytest.raises(RelayConfigError):
        ServeLimits(max_conns_per_peer=0)
    assert issubclass(RelayConfigError, RelayError) and issubclass(RelayConfigError, ConfigError)


def test_a_store_where_a_file_stands_is_a_storage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="file") as caught:
        Store(tmp_path / "file" / "store")
    assert isinstance(caught.value, RelayError) and isinstance(caught.value, PrimeError)


def test_publishing_into_an_unusable_store_is_a_publish_error(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(PublishError, match="file"):
        publish_blocking(ckpt, tmp_path / "file" / "store", identity=Identity.create(), run_id="r")


def test_a_background_publish_that_the_disk_refuses_is_a_publish_error(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path)
    versions = tmp_path / "store" / "versions"
    versions.mkdir(parents=True)
    publisher = Publisher(versions, identity=Identity.create(), run_id="r")
    try:
        versions.rmdir()
        versions.write_text("the versions directory was replaced by a file")
        version = publisher.publish(ckpt)
        with pytest.raises(PublishError, match=str(versions)):
            publisher.wait(version, timeout=30)
    finally:
        publisher.close()


def test_a_port_in_use_is_a_config_error(tmp_path: Path) -> None:
    async def body() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            server = ShardServer(Store(tmp_path / "s"), role="origin", port=taken.getsockname()[1])
            with pytest.raises(RelayConfigError, match="cannot listen"):
                await server.start()
            await server.stop()
    asyncio.run(asyncio.wait_for(body(), 10))


@pytest.mark.parametrize(("peer", "key"), [
    (("127.0.0.2", 5000), "127.0.0.2"),
    (("2001:db8::1", 5000, 0, 0), "2001:db8::/64"),
    (("2001:db8::ffff:1", 6000, 0, 0), "2001:db8::/64"),  # the same /64: one peer
    (("::ffff:10.0.0.7", 5000, 0, 0), "10.0.0.7"),
])
def test_connection_limits_count_ipv4_addresses_and_ipv6_slash_64s(peer: tuple[object, ...], key: str) -> None:
    assert peer_key(peer) == key


# Builtin exceptions the package raises on purpose, each caught inside it or required by the language.
_CAUGHT_INSIDE = {
    ("__init__.py", "AttributeError"),  # module __getattr__ (lazy imports): the protocol Python defines
    ("manifest.py", "ValueError"),  # pydantic validators; SignedManifest.parse turns them into ManifestError
    ("cli.py", "AssertionError"),  # an unknown subcommand, which argparse has already refused
    ("sendfile.py", "ValueError"),  # parse_range: an unsatisfiable Range, answered 416 by send_file
    ("sendfile.py", "ConnectionResetError"),  # the client went away: send_file aborts the connection
    ("sendfile.py", "ConnectionAbortedError"),  # a shard file shorter than its size: same
    ("transfer.py", "OSError"),  # a pwrite that wrote nothing: Downloader turns it into StorageError
}


def test_the_package_raises_no_bare_builtin_errors() -> None:
    """What escapes to callers derives from RelayError: a raise of a builtin exception is either caught
    inside the package (listed above, with where) or a bug."""
    builtin_errors = {name for name, value in vars(builtins).items()
                      if isinstance(value, type) and issubclass(value, BaseException)} - {"SystemExit"}
    found = set()
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(target, ast.Name) and target.id in builtin_errors:
                    found.add((path.name, target.id))
    assert found <= _CAUGHT_INSIDE, found - _CAUGHT_INSIDE
