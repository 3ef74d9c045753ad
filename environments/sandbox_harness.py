"""The sandbox's supervisor and candidate processes. Runs as `python -I -S -c <this file's text>`;
stdlib only (the repository is not visible inside the sandbox).

    grader --stdin: request / stdout: control lines--> supervisor --fork--> candidate

The supervisor is trusted and never runs candidate code. It reads the request, enters new
namespaces when it may, forks the candidate, and relays what the candidate writes on its result
pipe to the grader, base64-wrapped and unparsed (so nothing the candidate writes is parsed outside
the grader's depth-limited parser). It owns the clock, the output budget and (without namespaces)
the working-directory budget, kills the candidate and reports how it ended. The control pipe to the
grader never reaches the candidate: the supervisor is not dumpable and, except in mode `none`, runs
as another user or outside the candidate's PID namespace.

The candidate locks itself down before the first byte of candidate code runs, in this order:
1. descriptors: only the result pipe (fd 3) and /dev/null on 0-2; everything else closed;
2. `namespaces` mode (root): it is PID 1 of a new PID namespace (with its own /proc) in new mount,
   network, IPC, UTS and cgroup namespaces, chrooted into a fresh read-only root holding only /usr
   (and /bin, /lib... links), the interpreter's prefix, four /dev nodes, an empty /etc and a
   size- and inode-limited tmpfs on /tmp; no network interface but a downed loopback;
3. its own session; a uid and gid of its own (not the grader's, not shared with other runs) unless
   the mode is `none`; no new privileges; SIGKILL when the supervisor dies;
4. a seccomp filter refusing sockets, exec, ptrace, cross-process memory access and io_uring;
5. rlimits: CPU, address space, file size, open files, processes (0), core dumps (0);
6. an audit hook refusing process creation, sockets, ctypes, signals and writes outside the working
   directory (a second line of defence only: the kernel-enforced layers above are what hold).
Then it writes `{"ready": <layers>}` and runs the code. Everything after that line is the
candidate's own claim about its own return values: the grader compares them with expected outputs
that never left the grader, so a forged line can only be right if the candidate computed it.

Control lines (supervisor -> grader), JSON:
    {"isolation": {...}}                      the candidate is locked down; its clock starts
    {"result": "<base64 of one raw line>"}    at most one per input, in order
    {"end": {"fatal": null | "...", "status": int}}
    {"unavailable": "why"}                    no isolation of the requested kind here
    {"failed": "why"}                         the candidate could not be set up or started in time
(the grader turns the last two into `UngradableError`: no candidate code ran).
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import resource
import selectors
import signal
import sys
import time
from typing import Any

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
UID_BASE = 0x70000000
"""Candidate uids are UID_BASE + the supervisor's pid: unused by real accounts, and distinct for
every run alive at the same time (pids are), so one candidate cannot signal or trace another."""
NOBODY = 65534
RESULT_FD = 3
READY_LINE_MAX = 64 * 1024
WORKDIR = "/tmp/sandbox-work"
WORKDIR_CHECK_S = 0.02
"""Without namespaces, how often the supervisor measures the working directory."""
TOP_LEVEL = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
DEV_NODES = ("null", "zero", "random", "urandom")


def _emit(msg: dict[str, Any]) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


def _c(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def _mount(libc: Any, source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    if libc.mount(_c(source), _c(target), _c(fstype), flags, _c(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _bind_readonly(libc: Any, source: str, target: str) -> None:
    _mount(libc, source, target, None, MS_BIND | MS_REC)
    _mount(libc, None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _private_root(libc: Any, limits: dict[str, Any], uid: int, status: dict[str, Any]) -> None:
    """Build a minimal root on a tmpfs and chroot into it (we are PID 1 of the new namespaces).

    An allow-list rather than tmpfs over a list of sensitive directories: whatever the host keeps
    in /etc, /work, /opt or /var is simply not there.
    """
    root = "/tmp"  # only a mount point: this mount namespace is private, the host's /tmp is untouched
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID, "size=1m,nr_inodes=256,mode=0755")
    bound: list[str] = []
    for name in TOP_LEVEL:
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), root + host)
        elif os.path.isdir(host):
            os.mkdir(root + host)
            _bind_readonly(libc, host, root + host)
            bound.append(host)
    prefix = os.path.realpath(sys.base_prefix)
    resolved = [os.path.realpath(b) for b in bound]
    if not any(prefix == b or prefix.startswith(b + "/") for b in resolved):
        os.makedirs(root + prefix)
        _bind_readonly(libc, prefix, root + prefix)
        bound.append(prefix)
    for name in ("dev", "etc", "proc", "tmp"):
        os.mkdir(root + "/" + name)
    for node in DEV_NODES:
        if os.path.exists("/dev/" + node):
            os.close(os.open(f"{root}/dev/{node}", os.O_CREAT | os.O_WRONLY, 0o666))
            _mount(libc, "/dev/" + node, f"{root}/dev/{node}", None, MS_BIND)
    try:  # a /proc of this PID namespace: it lists the candidate alone
        _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        status["proc"] = True
    except OSError:
        pass  # an empty /proc reveals even less
    # The working directory's own tmpfs bounds its total size and its number of files.
    _mount(libc, "tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={limits['workdir_bytes']},nr_inodes={limits['workdir_files'] + 2},mode=0755")
    os.mkdir(root + WORKDIR, 0o700)
    os.chown(root + WORKDIR, uid, uid)
    _mount(libc, None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID)
    os.chroot(root)
    os.chdir(WORKDIR)
    status["root"] = "private"
    status["visible"] = sorted(bound)


def _audit(workdir: str) -> None:
    import posixpath

    blocked = ("os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "os.spawn",
               "subprocess.Popen", "pty.spawn", "socket.__new__", "socket.connect", "socket.bind",
               "socket.getaddrinfo", "ctypes.", "os.kill", "os.killpg", "signal.pthread_kill",
               "signal.pidfd_send_signal", "sys._current_frames", "os.chown", "os.setuid",
               "mmap.__new__", "_posixsubprocess")
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


def _write_line(text: str) -> None:
    data = (text + "\n").encode()
    while data:
        data = data[os.write(RESULT_FD, data):]


# seccomp: syscalls refused with EPERM, per architecture (socket, socketpair, execve, execveat,
# ptrace, process_vm_readv, process_vm_writev, io_uring_setup: io_uring can open sockets itself).
SECCOMP_DENY = {
    "x86_64": (0xC000003E, (41, 53, 59, 322, 101, 310, 311, 425)),
    "aarch64": (0xC00000B7, (198, 199, 221, 281, 117, 270, 271, 425)),
}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_EPERM = 0x7FFF0000, 0x00050000 | 1
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06


def _seccomp(libc: Any) -> bool:
    """Refuse network, exec and tracing syscalls in the kernel, whatever the candidate does to the
    audit hook. An allow-by-default filter on a short list: what matters without namespaces is
    the network; the uid already stops signals and writes. False on an unknown architecture."""

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                    ("k", ctypes.c_uint)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    if os.uname().machine not in SECCOMP_DENY:
        return False
    arch, numbers = SECCOMP_DENY[os.uname().machine]
    deny_at = 4 + len(numbers) + 1  # index of the final "refuse" instruction
    code = [(BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch: refuse every other ABI (i386 via int 0x80)
            (BPF_JEQ_K, 0, deny_at - 2, arch),
            (BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
            (BPF_JGE_K, deny_at - 4, 0, 0x40000000)]  # x32 numbers reach the same calls
    code += [(BPF_JEQ_K, deny_at - (4 + i) - 1, 0, nr) for i, nr in enumerate(numbers)]
    code += [(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW), (BPF_RET_K, 0, 0, SECCOMP_RET_EPERM)]
    instructions = (Filter * len(code))(*[Filter(*c) for c in code])
    program = Program(len(code), instructions)
    return bool(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) == 0)


def _stdlib_by_descriptor() -> None:
    """Point the import path at descriptors opened while still root.

    Without a private root the interpreter's files may lie under a directory the candidate's uid
    cannot enter (here /root/.pyenv); /proc/self/fd/N reaches them without searching its parents.
    The descriptors give nothing but what the import path already names.
    """
    reach: dict[str, str] = {}
    for entry in sys.path:
        if os.path.isdir(entry):
            reach[entry.rstrip("/") + "/"] = f"/proc/self/fd/{os.open(entry, os.O_RDONLY | os.O_DIRECTORY)}/"

    def moved(path: str) -> str:
        for old, new in reach.items():
            if (path + "/").startswith(old):
                return (new + path[len(old):]).rstrip("/")
        return path

    sys.path[:] = [moved(p) for p in sys.path]
    for module in list(sys.modules.values()):  # packages imported already (encodings...) find
        search = getattr(module, "__path__", None)  # their submodules through __path__
        if isinstance(search, list):
            search[:] = [moved(p) for p in search]
    sys.path_importer_cache.clear()


def _lock_down(libc: Any, request: dict[str, Any], mode: str, uid: int) -> dict[str, Any]:
    limits = request["limits"]
    status: dict[str, Any] = {"mode": mode, "netns": mode == "namespaces", "pidns": mode == "namespaces",
                              "proc": False, "root": "host", "uid": os.geteuid(), "rlimits": False,
                              "audit": False}
    if mode == "namespaces":
        _private_root(libc, limits, uid, status)
        workdir = WORKDIR
    else:
        workdir = request["workdir"]
        os.chdir(workdir)
    os.setsid()  # its own session and process group: kill(0, ...) reaches nobody else
    if mode == "uid":
        _stdlib_by_descriptor()
    if mode != "none":
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        status["uid"] = os.geteuid()
    # After the uid change (which clears it): die with the supervisor, whatever the candidate does.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    status["seccomp"] = _seccomp(libc)
    cpu = limits["cpu_s"]
    for res, value in ((resource.RLIMIT_CPU, (cpu, cpu)),
                       (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
                       (resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2),
                       (resource.RLIMIT_NOFILE, (32, 32)),
                       (resource.RLIMIT_NPROC, (0, 0)),
                       (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(res, value)
    status["rlimits"] = True
    _audit(workdir)
    status["audit"] = True
    return status


def _candidate(libc: Any, request: dict[str, Any], mode: str, uid: int, result_w: int) -> None:
    """The child: lock down, report ready, run the code, one result line per input."""
    if result_w != RESULT_FD:
        os.dup2(result_w, RESULT_FD)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # fd 1 was the supervisor's control pipe
        os.dup2(null, fd)
    os.closerange(RESULT_FD + 1, 1 << 20)
    try:
        status = _lock_down(libc, request, mode, uid)
    except BaseException as exc:
        _write_line(json.dumps({"setup_error": f"{type(exc).__name__}: {exc}"[:300]}))
        return
    _write_line(json.dumps({"ready": status}))
    sys.setrecursionlimit(2000)
    max_line = request["max_result_bytes"]
    namespace = {"__name__": "__candidate__", "__builtins__": __builtins__}
    try:
        exec(compile(request["code"], "<candidate>", "exec"), namespace)
        fn = namespace[request["entry_point"]]
        if not callable(fn):
            raise TypeError("entry point is not callable")
    except BaseException as exc:  # the candidate's failure is data: report it and stop
        _write_line(json.dumps({"fatal": type(exc).__name__}))
        return
    dumps = json.dumps
    for args in request["inputs"]:
        try:
            line = dumps({"value": _json_safe(fn(*args))})
            if len(line) > max_line:
                line = dumps({"error": "oversize"})
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: fail this test only
            line = dumps({"error": type(exc).__name__})
        _write_line(line)


def _workdir_usage(path: str, max_entries: int) -> tuple[int, int]:
    """(bytes allocated, entries) under `path`, without following links; stops past max_entries."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    total = entries = 0
    stack = [os.open(path, flags)]
    try:
        while stack and entries <= max_entries:
            fd = stack.pop()
            try:
                with os.scandir(fd) as it:
                    for entry in it:
                        entries += 1
                        if entries > max_entries:
                            break  # over the budget already; a huge directory is not listed in full
                        try:
                            st = entry.stat(follow_symlinks=False)
                            total += st.st_blocks * 512
                            if entry.is_dir(follow_symlinks=False):
                                stack.append(os.open(entry.name, flags, dir_fd=fd))
                        except OSError:
                            continue  # gone or swapped for a link since the listing
            finally:
                os.close(fd)
    finally:
        for fd in stack:
            os.close(fd)
    return total, entries


def _relay(pid: int, result_r: int, request: dict[str, Any], mode: str) -> None:
    """Forward the candidate's lines within the limits, then kill it and report how it ended."""
    limits = request["limits"]
    n_inputs = len(request["inputs"])
    line_max = request["max_result_bytes"] + 64
    watch = request["workdir"] if mode != "namespaces" else None  # a tmpfs bounds it otherwise
    deadline = time.monotonic() + request["start_s"]
    ready = False
    fatal: str | None = None
    setup_error: str | None = None
    buf = b""
    total = forwarded = 0
    next_check = 0.0
    with selectors.DefaultSelector() as sel:
        sel.register(result_r, selectors.EVENT_READ)
        while not (ready and forwarded >= n_inputs):
            now = time.monotonic()
            if now >= deadline:
                fatal = "timeout"
                break
            if watch is not None and ready and now >= next_check:
                used, entries = _workdir_usage(watch, limits["workdir_files"])
                if used > limits["workdir_bytes"] or entries > limits["workdir_files"]:
                    fatal = "workdir_full"
                    break
                next_check = now + WORKDIR_CHECK_S
            if not sel.select(min(deadline - now, WORKDIR_CHECK_S) if watch is not None else deadline - now):
                continue
            chunk = os.read(result_r, 65536)
            if not chunk:
                break  # the candidate exited or closed its pipe
            total += len(chunk)
            if total > limits["output_bytes"] + READY_LINE_MAX:
                fatal = "oversize_output"
                break
            buf += chunk
            while b"\n" in buf and not (ready and forwarded >= n_inputs) and setup_error is None:
                line, buf = buf.split(b"\n", 1)
                if not ready:  # written by harness code before any candidate code ran
                    msg = json.loads(line)
                    if "ready" not in msg:
                        setup_error = str(msg.get("setup_error", "bad ready line"))
                        break
                    ready = True
                    _emit({"isolation": msg["ready"]})
                    deadline = time.monotonic() + request["wall_s"]
                    continue
                _emit({"result": base64.b64encode(line).decode()})
                forwarded += 1
            if setup_error is not None:
                break
            if len(buf) > (line_max if ready else READY_LINE_MAX):
                fatal = "oversize_output"
                break
    try:
        os.kill(pid, signal.SIGKILL)  # by pid: a candidate that left our process group is still ours
    except ProcessLookupError:
        pass
    _, wait_status = os.waitpid(pid, 0)
    if not ready:
        why = setup_error or (f"the candidate process did not start within {request['start_s']} s"
                              if fatal == "timeout" else f"the candidate process died during setup "
                              f"(wait status {wait_status})")
        _emit({"failed": why})
        return
    if fatal is None and forwarded < n_inputs and os.WIFSIGNALED(wait_status):
        fatal = "crashed"  # RLIMIT_CPU, a segfault from deep recursion, the kernel's OOM killer...
    _emit({"end": {"fatal": fatal, "status": wait_status}})


def main() -> None:
    request = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    libc = ctypes.CDLL(None, use_errno=True)
    # Not dumpable: a candidate with our uid (mode `none`) cannot open /proc/<us>/fd/1 or our memory.
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    mode = request["mode"]
    if mode in ("auto", "namespaces"):
        flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
        if libc.unshare(flags) == 0:
            if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
                # Our mounts would leak to the host's namespace: refuse rather than continue.
                _emit({"unavailable": f"making / private: {os.strerror(ctypes.get_errno())}"})
                return
            mode = "namespaces"
        elif mode == "namespaces":
            _emit({"unavailable": f"unshare: {os.strerror(ctypes.get_errno())} (needs root with "
                                  "CAP_SYS_ADMIN and a seccomp profile that allows unshare/mount)"})
            return
        else:
            mode = "uid"
    uid = os.getuid()
    if mode != "none":
        uid = UID_BASE + os.getpid()
        try:  # in a user namespace with few mapped uids the per-run uid may not exist
            os.setresuid(-1, uid, -1)
            os.setresuid(-1, 0, -1)
        except OSError:
            uid = NOBODY
        if mode == "uid":
            os.chown(request["workdir"], uid, uid)
            os.chmod(request["workdir"], 0o700)
    result_r, result_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(result_r)
            _candidate(libc, request, mode, uid, result_w)
        except BaseException:
            code = 70
        finally:
            os._exit(code)  # never fall back into the supervisor's code
    os.close(result_w)
    _relay(pid, result_r, request, mode)


main()
