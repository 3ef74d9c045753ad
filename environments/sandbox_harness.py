"""The child side of the code sandbox. Runs as `python -I -S -c <this file's text>`; stdlib only.

It reads one JSON request on stdin, locks itself down, runs the candidate's code, calls the entry
point on each hidden input and writes one JSON line per result on its (saved) stdout. It never sees
expected outputs: the grader compares in its own process, so nothing the candidate does in here can
forge a pass. Steps, in order (each recorded in the first output line, `{"isolation": ...}`):

1. new mount, network, IPC and UTS namespaces (needs root / CAP_SYS_ADMIN; skipped otherwise):
   no network interfaces but a downed loopback; fresh small tmpfs over /tmp, /var/tmp, /dev/shm,
   /run, /root, /home and the directories the grader names (the repository), the interpreter's
   prefix bound back read-only where it lay under a hidden directory;
2. drop to uid/gid `nobody` (when root), so file permissions and RLIMIT_NPROC apply;
3. resource limits: CPU seconds, address space, file size, open files, processes (0), core 0;
4. an audit hook refusing process creation, sockets, ctypes, signals to others, and writes
   (open for writing, remove, rename, mkdir, chmod...) outside the working directory;
5. stdin/stdout/stderr pointed at /dev/null, so prints cost nothing and cannot corrupt results.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
from typing import Any

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWIPC, CLONE_NEWUTS = 0x20000, 0x40000000, 0x8000000, 0x4000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
NOBODY = 65534


def _namespaces(libc: Any, hidden: list[str], tmpfs_bytes: int, status: dict[str, Any]) -> None:
    if libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS) != 0:
        return
    status["netns"] = True
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return
    prefix = os.path.realpath(sys.base_prefix)
    covered = [d for d in hidden if prefix == d or prefix.startswith(d.rstrip("/") + "/")]
    staging = b"/mnt"
    if covered:
        # Bind the interpreter somewhere visible before its parent is hidden, then back in place.
        if not os.path.isdir(staging) or libc.mount(b"tmpfs", staging, b"tmpfs", 0, b"size=64k") != 0:
            return
        os.mkdir(b"/mnt/py")
        if libc.mount(prefix.encode(), b"/mnt/py", None, MS_BIND | MS_REC, None) != 0:
            return
    for d in hidden:
        opts = f"size={tmpfs_bytes},mode={'1777' if d in ('/tmp', '/var/tmp', '/dev/shm') else '0755'}"
        if os.path.isdir(d) and libc.mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                                           opts.encode()) == 0:
            status["hidden"].append(d)
    if covered:
        os.makedirs(prefix, exist_ok=True)
        libc.mount(b"/mnt/py", prefix.encode(), None, MS_BIND | MS_REC, None)
        libc.mount(None, prefix.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
        libc.umount2(staging, 2)  # MNT_DETACH: the bind at `prefix` stays


def _audit(workdir: str) -> None:
    import posixpath

    blocked = ("os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "os.spawn",
               "subprocess.Popen", "pty.spawn", "socket.__new__", "socket.connect", "socket.bind",
               "socket.getaddrinfo", "ctypes.", "os.kill", "os.killpg", "signal.pthread_kill",
               "sys._current_frames", "os.chown", "os.setuid", "mmap.__new__", "_posixsubprocess")
    path_events = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.symlink",
                   "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile")
    root = workdir.rstrip("/") + "/"
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    abspath, normpath = posixpath.abspath, posixpath.normpath

    def inside(path: Any) -> bool:
        if isinstance(path, int):
            return True
        if isinstance(path, bytes):
            path = path.decode(errors="replace")
        return (normpath(abspath(str(path))) + "/").startswith(root)

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event.startswith(blocked):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags)
            if writing and not inside(path):
                raise PermissionError("sandbox: writes outside the working directory are not allowed")
        elif event in path_events:
            for a in args[:2]:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                    raise PermissionError(f"sandbox: {event} outside the working directory")

    sys.addaudithook(hook)


def _json_safe(value: Any, depth: int = 0) -> Any:
    # Tuples become lists, like a JSON round trip; anything else non-JSON is reported by type.
    if depth > 100:
        raise ValueError("nesting too deep")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v, depth + 1) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_safe(v, depth + 1) for k, v in value.items()}
    raise TypeError(type(value).__name__)


def main() -> None:
    request = json.loads(sys.stdin.buffer.read())
    out = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    limits = request["limits"]
    status: dict[str, Any] = {"netns": False, "hidden": [], "uid": os.geteuid(), "rlimits": False, "audit": False}
    privileged = os.geteuid() == 0 and request["isolate"]
    if privileged:
        libc = ctypes.CDLL(None, use_errno=True)
        _namespaces(libc, request["hidden"], limits["tmpfs_bytes"], status)
    workdir = "/tmp/sandbox-work" if "/tmp" in status["hidden"] else request["fallback_workdir"]
    os.makedirs(workdir, exist_ok=True)
    if privileged:
        os.chown(workdir, NOBODY, NOBODY)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        status["uid"] = os.geteuid()
    os.chdir(workdir)
    cpu = limits["cpu_s"]
    for res, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                       (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
                       (resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2),
                       (resource.RLIMIT_NOFILE, (32, 32)),
                       (resource.RLIMIT_NPROC, (0, 0)),
                       (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(res, value)
    status["rlimits"] = True
    _audit(workdir)
    status["audit"] = True
    sys.setrecursionlimit(2000)
    max_line = limits["max_result_bytes"]
    out.write(json.dumps({"isolation": status}) + "\n")
    namespace = {"__name__": "__candidate__", "__builtins__": __builtins__}
    try:
        exec(compile(request["code"], "<candidate>", "exec"), namespace)
        fn = namespace[request["entry_point"]]
        if not callable(fn):
            raise TypeError("entry point is not callable")
    except BaseException as exc:  # the candidate's failure is data: report it and stop
        out.write(json.dumps({"fatal": type(exc).__name__}) + "\n")
        return
    dumps = json.dumps
    for i, args in enumerate(request["inputs"]):
        try:
            line = dumps({"i": i, "value": _json_safe(fn(*args))})
            if len(line) > max_line:
                line = dumps({"i": i, "error": "oversize"})
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: fail this test only
            line = dumps({"i": i, "error": type(exc).__name__})
        out.write(line + "\n")


main()
