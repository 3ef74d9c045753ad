"""The code sandbox against a hostile candidate (issue 11): escapes, the result channel, budgets, and
which failures are the candidate's (a low reward) versus the grader's (`UngradableError`).

Most attacks first disarm the audit hook (its closure cells are reachable through `gc`): what must
hold is the kernel-enforced layers, in namespace mode and in the uid fallback alike.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from environments.programming import CodeEnvironment
from environments.sandbox import SandboxLimits, SandboxResult, SandboxUnavailableError, run_sandboxed
from protocol.errors import ConfigError, UngradableError
from tests.unit.environments.sandbox_modes import candidate_processes, skip_unless_mode

REPO = Path(__file__).resolve().parents[3]

# Empties the audit hook's tuples, zeroes its flags and widens its working directory to everything.
DISARM = """
import gc
for _o in gc.get_objects():
    if getattr(_o, '__name__', None) in ('hook', 'inside') and getattr(_o, '__closure__', None):
        for _c in _o.__closure__:
            _v = _c.cell_contents
            _c.cell_contents = () if isinstance(_v, tuple) else 0 if type(_v) is int else '' if isinstance(_v, str) else _v
"""


def limits(mode: str, **kw: object) -> SandboxLimits:
    return SandboxLimits(wall_s=5.0, cpu_s=2, memory_bytes=256 * 2**20, isolation=mode, **kw)  # type: ignore[arg-type]


def run(mode: str, body: str, **kw: object) -> SandboxResult:
    return run_sandboxed(DISARM + body, "f", [[]], limits(mode, **kw))


@pytest.fixture
def victim_dir() -> Iterator[Path]:
    """A root-owned directory every user may enter and read, on the host's /tmp."""
    path = Path(tempfile.mkdtemp(prefix="prime-victim-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_audit_hook_disarm_works() -> None:
    # The premise of the tests below: with the hook disarmed, the audit layer no longer refuses.
    skip_unless_mode("uid")
    assert run("uid", "import os\ndef f():\n    os.kill(os.getpid(), 0)\n    return 'ok'").values[0] == {"value": "ok"}


def test_no_write_outside_through_dir_fd(sandbox_mode: str, victim_dir: Path) -> None:
    body = (f"import os\ndef f():\n    d = os.open({str(victim_dir)!r}, os.O_RDONLY)\n"
            "    fd = os.open('pwned', os.O_WRONLY | os.O_CREAT, dir_fd=d)\n    return os.write(fd, b'x')")
    result = run(sandbox_mode, body)
    assert "error" in result.values[0]  # type: ignore[operator]
    assert list(victim_dir.iterdir()) == []


def test_no_process_through_posixsubprocess(sandbox_mode: str, victim_dir: Path) -> None:
    marker = victim_dir / "forked"
    victim_dir.chmod(0o777)  # even where the child could write, it must not exist
    body = ("import _posixsubprocess, os\ndef f():\n    r, w = os.pipe()\n"
            f"    return _posixsubprocess.fork_exec([b'/bin/touch', {str(marker).encode()!r}], [b'/bin/touch'],"
            " True, (w,), None, None, -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1,"
            " None, False)")
    result = run(sandbox_mode, body)
    assert "error" in result.values[0]  # type: ignore[operator]
    time.sleep(0.2)
    assert not marker.exists()


def test_signals_reach_no_process_but_the_candidate(sandbox_mode: str) -> None:
    body = ("import os, signal\ndef f():\n    ok = []\n    listing = os.listdir('/proc')\n"
            "    for p in listing:\n        if p.isdigit():\n            try:\n"
            "                fd = os.pidfd_open(int(p))\n            except OSError:\n                continue\n"
            "            try:\n                signal.pidfd_send_signal(fd, 0)\n                ok.append(int(p))\n"
            "            except OSError:\n                pass\n            finally:\n                os.close(fd)\n"
            "    return [os.getpid(), ok, listing]")
    result = run(sandbox_mode, body)
    own, reachable, listing = result.values[0]["value"]  # type: ignore[index]
    assert reachable == [own]
    if sandbox_mode != "namespaces":  # the host's /proc: many processes listed, none reachable
        assert sum(p.isdigit() for p in listing) > 3


def test_kill_everything_leaves_the_grader_standing(sandbox_mode: str) -> None:
    # kill(-1) signals every process the caller may signal: with its own uid / PID namespace, none.
    # Never run against a sandbox that leaves the candidate root: kill(-1) would end the machine.
    body = ("import os, signal\ndef f():\n    try:\n        os.kill(-1, signal.SIGKILL)\n"
            "    except ProcessLookupError:\n        pass\n    return 1")
    result = run(sandbox_mode, body)
    assert result.values[0] == {"value": 1}  # the grader and supervisor still stand to collect it


@pytest.mark.timeout(60)
def test_no_network(sandbox_mode: str) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    body = (f"import socket\ndef f():\n    s = socket.create_connection(('127.0.0.1', {port}), 2)\n"
            "    s.sendall(b'exfiltrated')\n    return 'sent'")
    try:
        result = run(sandbox_mode, body)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    assert result.values[0] in ({"error": "PermissionError"}, {"error": "OSError"})


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="syscall numbers below are x86_64's")
def test_raw_socket_syscalls_are_refused(sandbox_mode: str) -> None:
    # Straight to the kernel (ctypes, hook disarmed): socket(2) natively and through the x32 ABI.
    body = ("import ctypes\ndef f():\n    libc = ctypes.CDLL(None, use_errno=True)\n    out = []\n"
            "    for nr in (41, 0x40000000 + 41):\n        rc = libc.syscall(nr, 2, 1, 0)\n"
            "        out.append([rc, ctypes.get_errno()])\n    return out")
    result = run(sandbox_mode, body)
    assert result.isolation["seccomp"] is True
    assert result.values[0] == {"value": [[-1, 1], [-1, 1]]}  # EPERM both times


GRADER = """
import json, sys
from environments.sandbox import SandboxLimits, run_sandboxed
code = sys.stdin.read()
r = run_sandboxed(code, "f", [[]], SandboxLimits(wall_s=5.0, cpu_s=2, isolation=sys.argv[1]))
print(json.dumps(r.values[0]))
"""


def grade_in_subprocess(mode: str, code: str, secret: str) -> object:
    """A grader with `secret` in its environment from the start (what /proc/<pid>/environ shows)."""
    env = {**os.environ, "PRIME_KEYSTORE_PASSWORD": secret}
    out = subprocess.run([sys.executable, "-c", GRADER, mode], input=code, capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
def test_grader_environment_is_unreadable(sandbox_mode: str) -> None:
    secret = secrets.token_hex(16)
    body = (f"import os\ndef f():\n    seen = found = 0\n    for p in os.listdir('/proc'):\n"
            f"        for name in ('environ', 'cmdline'):\n            try:\n"
            f"                data = open(f'/proc/{{p}}/{{name}}', 'rb').read()\n            except OSError:\n"
            f"                continue\n            seen += 1\n            found += {secret.encode()!r} in data\n"
            f"    return [seen, found]")
    seen, found = grade_in_subprocess(sandbox_mode, DISARM + body, secret)["value"]  # type: ignore[index]
    assert found == 0 and seen > 0
    if sandbox_mode == "uid":
        # Control: the same probe with the grader's own uid (mode none, as root here) finds it.
        assert grade_in_subprocess("none", DISARM + body, secret)["value"][1] > 0  # type: ignore[index]


@pytest.mark.parametrize("body", [
    # Far past the 4 MiB budget (each file is capped at 1 MiB by RLIMIT_FSIZE); stopped long before.
    "def f():\n    for i in range(10**6):\n        open(f'f{i}', 'wb').write(b'x' * 2**20)\n    return i",
    "def f():\n    for i in range(100000):\n        open(f'f{i}', 'wb').close()\n    return i",
], ids=["bytes", "files"])
def test_working_directory_is_bounded(sandbox_mode: str, body: str) -> None:
    result = run(sandbox_mode, body)
    assert "value" not in result.values[0]  # type: ignore[operator]
    if sandbox_mode == "namespaces":  # a size- and inode-limited tmpfs: ENOSPC
        assert result.values[0] == {"error": "OSError"}
    else:  # measured by the supervisor, which kills the candidate
        assert result.fatal == "workdir_full"


BOMBS = [
    "'[' * 200000 + '\\n'",                          # RecursionError in the stdlib parser before
    "'[' * 5000 + ']' * 5000 + '\\n'",               # valid JSON, too deep
    "'{\"value\": 3}' * 1000 + '\\n'",
    "'\\xff\\xfe\\n'",                               # not UTF-8
    "'{\"isolation\": {\"mode\": \"namespaces\", \"netns\": true}}\\n{\"end\": {\"fatal\": null}}\\n'",
]


@pytest.mark.parametrize("bomb", BOMBS, ids=[f"bomb{i}" for i in range(len(BOMBS))])
def test_result_channel_garbage_is_a_wrong_answer(sandbox_mode: str, bomb: str) -> None:
    env = CodeEnvironment(limits(sandbox_mode))
    spec = {"entry_point": "add", "tests": [{"args": [1, 2], "expected": 3}, {"args": [2, 2], "expected": 4},
                                             {"args": [0, 0], "expected": 0}]}
    task = env.task_from("Write add(a, b).", json.dumps(spec))
    code = (f"{DISARM}\nimport os\nfor fd in range(40):\n    try:\n"
            f"        os.write(fd, ({bomb}).encode('latin-1'))\n    except OSError:\n        pass\n"
            "def add(a, b):\n    return a + b\n")
    reward = env.reward(task, f"```python\n{code}```")
    assert 0.0 <= reward < 1.0  # the garbage line costs (at least) one test; nothing raises
    result = run_sandboxed(code, "add", [[1, 2]], limits(sandbox_mode))
    assert result.isolation["mode"] == sandbox_mode  # the forged isolation report went nowhere
    assert result.isolation["netns"] is (sandbox_mode == "namespaces")


@pytest.mark.skipif(os.geteuid() != 0, reason="not root: the sandbox refuses before starting anything")
def test_sandbox_that_cannot_start_in_time_is_ungradable() -> None:
    # No time at all to start (a grader so loaded that start-up overran): the candidate never ran.
    with pytest.raises(UngradableError, match="did not start"):
        run_sandboxed("def f():\n    return 1", "f", [[]], SandboxLimits(start_s=0.0))
    env = CodeEnvironment(SandboxLimits(start_s=0.0))  # and so is the reward: no 0 for a right answer
    task = env.task_from("Write f.", json.dumps({"entry_point": "f", "tests": [{"args": [], "expected": 1}]}))
    with pytest.raises(UngradableError):
        env.reward(task, "```python\ndef f():\n    return 1\n```")


def supervisor_pids() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"The sandbox's supervisor" in cmdline:
            pids.append(int(entry))
    return pids


def children(pid: int) -> list[int]:
    """Live processes whose parent is `pid`."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            state, ppid = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == pid and state != "Z":
            out.append(int(entry))
    return out


@pytest.mark.timeout(60)
def test_supervisor_death_is_ungradable_and_takes_the_candidate(sandbox_mode: str) -> None:
    killed: list[int] = []

    def kill_supervisor() -> None:
        # Only once the candidate runs: the supervisor forks it after reading the whole request, so the
        # supervisor dies mid-run, the case this test is about. Killed before it had read the request, the
        # grader's write fails instead ("code sandbox died at start: [Errno 32] Broken pipe"), which an idle
        # machine's quick poll here used to hit.
        deadline = time.monotonic() + 20
        while not killed and time.monotonic() < deadline:
            for pid in supervisor_pids():
                if children(pid):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.02)

    thread = threading.Thread(target=kill_supervisor)
    thread.start()
    with pytest.raises(UngradableError) as raised:
        run_sandboxed("import time\ndef f():\n    time.sleep(10)\n    return 1", "f", [[]],
                      SandboxLimits(wall_s=15.0, isolation=sandbox_mode))  # type: ignore[arg-type]
    thread.join()
    assert killed
    # the class is the contract (the grader's failure, never a reward); the cause: its supervisor died
    assert "supervisor died" in str(raised.value), raised.value
    if sandbox_mode != "none":  # the candidate (uid = base + supervisor pid) dies with it: at once
        # (parent-death signal), or at its next write if the supervisor died before that was set.
        deadline = time.monotonic() + 10
        while candidate_processes(0x70000000 + killed[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert candidate_processes(0x70000000 + killed[0]) == []


def test_non_root_grader_refuses_unless_opted_in() -> None:
    """A grader that is not root cannot isolate candidates: it refuses, saying how to opt in."""
    def attempt() -> str:
        out = []
        for mode in ("auto", "namespaces", "uid"):
            try:
                run_sandboxed("def f():\n    return 1", "f", [[]], SandboxLimits(isolation=mode))  # type: ignore[arg-type]
                out.append("graded")
            except SandboxUnavailableError as exc:
                out.append(f"{exc.code}: {exc}")
        return json.dumps(out)

    if os.geteuid() != 0:
        outcomes = json.loads(attempt())
    else:  # drop to another user in a forked copy of this process (the interpreter is already loaded)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.setgid(65534)
                os.setuid(65534)
                os.write(w, attempt().encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            outcomes = json.loads(f.read())
        os.waitpid(pid, 0)
    assert len(outcomes) == 3
    for text in outcomes:
        assert text.startswith("sandbox_unavailable:") and "PRIME_SANDBOX_ISOLATION=none" in text


def test_isolation_default_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRIME_SANDBOX_ISOLATION", "none")
    assert SandboxLimits().isolation == "none"
    monkeypatch.setenv("PRIME_SANDBOX_ISOLATION", "off")
    with pytest.raises(ConfigError, match="PRIME_SANDBOX_ISOLATION"):
        SandboxLimits()
    monkeypatch.delenv("PRIME_SANDBOX_ISOLATION")
    assert SandboxLimits().isolation == "auto"


def test_mode_none_runs_as_the_graders_user() -> None:
    # Benign code only: as root this mode would hand the candidate root.
    result = run_sandboxed("import os\ndef f():\n    return os.geteuid()", "f", [[]], SandboxLimits(isolation="none"))
    assert result.isolation["mode"] == "none" and result.values[0] == {"value": os.geteuid()}
