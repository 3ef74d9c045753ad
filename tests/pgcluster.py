"""A throwaway PostgreSQL cluster for tests: `initdb` in a temp dir (trust auth), `postgres` on a free
127.0.0.1 port, one fresh database per test, `pg_ctl stop` at the end of the session.

PostgreSQL refuses to run as root, so as root the binaries run as an unprivileged user (`postgres`
when the Debian packages created it, else `nobody`) through `runuser`, and the temp dir is handed to
that user. Without `initdb`/`pg_ctl` (on PATH or under /usr/lib/postgresql/*/bin) the fixtures skip.

Use from a test module or conftest: `from pgcluster import pg_cluster, pg_dsn  # noqa: F401`.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netfixtures import free_port


def pg_bindir() -> Path | None:
    """The directory holding initdb and pg_ctl, or None when PostgreSQL is not installed."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(os.path.realpath(found)).parent
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name)
                        if p.parent.name.isdigit() else 0)
    for bindir in reversed(candidates):
        if (bindir / "initdb").exists() and (bindir / "pg_ctl").exists():
            return bindir
    return None


def _run_as() -> str | None:
    """The unprivileged user to run PostgreSQL as when we are root (None: run as ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise RuntimeError("running as root and neither a 'postgres' nor a 'nobody' user exists")


class PgCluster:
    """One running cluster (see the module docstring)."""

    def __init__(self, root: Path, bindir: Path, user: str | None, port: int) -> None:
        self.root, self.bindir, self.user, self.port = root, bindir, user, port
        self._names = itertools.count(1)

    def _cmd(self, tool: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        argv = [str(self.bindir / tool), *args]
        if self.user is not None:
            argv = ["runuser", "-u", self.user, "--", *argv]
        return subprocess.run(argv, cwd=self.root, capture_output=True, text=True, timeout=timeout)

    @classmethod
    def start(cls, bindir: Path) -> PgCluster:
        user = _run_as()
        root = Path(tempfile.mkdtemp(prefix="prime-pg-"))  # short: it also holds the unix socket
        if user is not None:
            info = pwd.getpwnam(user)
            os.chown(root, info.pw_uid, info.pw_gid)
        cluster = cls(root, bindir, user, 0)
        init = cluster._cmd("initdb", "-D", str(root / "data"), "-A", "trust", "-U", "postgres", "-E", "UTF8",
                            "--no-sync", "--no-instructions")
        if init.returncode != 0:
            shutil.rmtree(root, ignore_errors=True)
            raise RuntimeError(f"initdb failed: {init.stderr[-2000:]}")
        for _ in range(5):  # the free port can be taken before postgres binds it: try another
            cluster.port = free_port()
            opts = (f"-c listen_addresses=127.0.0.1 -p {cluster.port} -k {root} -c fsync=off "
                    "-c synchronous_commit=off -c full_page_writes=off")
            started = cluster._cmd("pg_ctl", "-D", str(root / "data"), "-l", str(root / "server.log"), "-w",
                                   "-t", "60", "-o", opts, "start")
            if started.returncode == 0:
                return cluster
            time.sleep(0.2)
        log = (root / "server.log").read_text(errors="replace")[-2000:] if (root / "server.log").exists() else ""
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"pg_ctl start failed: {started.stderr[-1000:]} {log}")

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, prefix: str = "t") -> str:
        """A new empty database; returns its DSN."""
        import psycopg

        name = f"{prefix}_{next(self._names)}"
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn(name)

    def stop(self) -> None:
        self._cmd("pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    bindir = pg_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL not installed (no initdb/pg_ctl on PATH or under /usr/lib/postgresql/*/bin)")
    cluster = PgCluster.start(bindir)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def pg_dsn(pg_cluster: PgCluster) -> str:
    """The DSN of a fresh, empty database of the session's cluster."""
    return pg_cluster.create_database()
