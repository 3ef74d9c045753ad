"""Known-answer table for code: right, partial, wrong, and hostile programs, all graded in the sandbox
in every isolation mode this machine supports (namespaces and uid as root, none otherwise)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

import environments
from environments.programming import CodeEnvironment, extract_code, same_value
from environments.sandbox import SandboxLimits, run_sandboxed
from tests.unit.environments.sandbox_modes import candidate_processes, skip_unless_mode

# Tight limits keep hostile cases quick; the defaults are wall 10 s, CPU 5 s.
LIMITS = SandboxLimits(wall_s=3.0, cpu_s=1, memory_bytes=256 * 2**20)
ENV = CodeEnvironment(LIMITS)


def env_for(mode: str) -> CodeEnvironment:
    return CodeEnvironment(LIMITS.model_copy(update={"isolation": mode}))

SPEC = {"entry_point": "add", "tests": [
    {"args": [1, 2], "expected": 3}, {"args": [-1, 1], "expected": 0},
    {"args": [10, 5], "expected": 15}, {"args": [0, 0], "expected": 0}]}
TASK = ENV.task_from("Write `add(a, b)` returning a + b.", json.dumps(SPEC))
MARKER = Path("/tmp/prime-sandbox-escape-marker")


def fenced(body: str) -> str:
    return f"Here you go:\n```python\n{body}\n```\n"


CASES: list[tuple[str, float]] = [
    (fenced("def add(a, b):\n    return a + b"), 1.0),
    ("```\ndef add(a, b):\n    return a + b\n```", 1.0),
    ("```py\ndef add(a, b):\n    return b + a\n```", 1.0),
    ("def add(a, b):\n    return a + b", 1.0),                         # no fence: whole text
    ("<think>try ```python\nx```</think>" + fenced("def add(a, b):\n    return a + b"), 1.0),
    (fenced("def add(a, b):\n    return a - b") + fenced("def add(a, b):\n    return a + b"), 1.0),
    ("```python\ndef add(a, b):\n    return a + b\n", 1.0),             # unclosed last fence
    (fenced("add = lambda a, b: a + b"), 1.0),
    (fenced("import operator\nadd = operator.add"), 1.0),
    (fenced("def add(a, b):\n    return a * b"), 0.25),                   # only 0*0 agrees
    (fenced("def add(a, b):\n    return 3"), 0.25),
    (fenced("def add(a, b):\n    return a - b"), 0.25),
    (fenced("def add(a, b):\n    return float(a + b)"), 1.0),             # 3.0 == 3 numerically
    (fenced("def add(a, b):\n    return str(a + b)"), 0.0),               # '3' is not 3
    (fenced("def add(a, b):\n    return a + b == 3"), 0.0),               # True is not 3
    (fenced("def add(a, b):\n    return [a + b]"), 0.0),
    (fenced("def plus(a, b):\n    return a + b"), 0.0),                   # wrong name
    (fenced("add = 3"), 0.0),                                             # not callable
    (fenced("def add(a, b):\n    return a +"), 0.0),                      # syntax error
    (fenced("def add(a, b):\n    raise ValueError('no')"), 0.0),
    ("", 0.0),
    ("no code at all", 0.0),
    (fenced("import time\ndef add(a, b):\n    time.sleep(60)"), 0.0),     # sleeps past wall time
    (fenced("def add(a, b):\n    while True:\n        pass"), 0.0),       # burns CPU past RLIMIT_CPU
    (fenced("import os\ndef add(a, b):\n    os.fork()\n    return a + b"), 0.0),
    (fenced("import os\ndef add(a, b):\n    while True:\n        os.fork()"), 0.0),  # fork bomb
    (fenced("import subprocess\ndef add(a, b):\n    subprocess.run(['true'])\n    return a + b"), 0.0),
    (fenced("def add(a, b):\n    x = bytearray(2**33)\n    return a + b"), 0.0),     # fills memory
    (fenced("def add(a, b):\n    x = [0] * 10**10\n    return a + b"), 0.0),
    (fenced(f"def add(a, b):\n    open({str(MARKER)!r}, 'w').write('x')\n    return a + b"), 0.0),
    (fenced("import socket\ndef add(a, b):\n    socket.create_connection(('127.0.0.1', 1), 1)\n"
            "    return a + b"), 0.0),
    (fenced("def add(a, b):\n    print('x' * 50_000_000)\n    return a + b"), 1.0),  # prints go nowhere
    (fenced("import os\ndef add(a, b):\n    os._exit(0)"), 0.0),
    (fenced("import sys\ndef add(a, b):\n    sys.exit(0)"), 0.0),
    (fenced("def add(a, b):\n    return add(a, b)"), 0.0),                  # infinite recursion
    (fenced("import sys\nsys.setrecursionlimit(10**6)\ndef add(a, b):\n    return add(a, b)"), 0.0),
    (fenced("def add(a, b):\n    return 'x' * 50_000_000"), 0.0),          # oversize return value
    # A line written on the result pipe (fd 3) counts as the candidate's answer to the next input:
    # the forged 3 is right for input 0, the real answers (all 0) shift by one (right for 1 and 3).
    (fenced("import os\nos.write(3, b'{\"i\": 0, \"value\": 3}\\n')\ndef add(a, b):\n    return 0"), 0.75),
    (fenced("import os\nos.write(3, b'[' * 200000)\ndef add(a, b):\n    return a + b"), 0.75),  # bomb eats line 0
    (fenced("import ctypes\ndef add(a, b):\n    ctypes.CDLL(None)\n    return a + b"), 0.0),
    (fenced("x" * 70_000), 0.0),                                          # code over 64 KiB: not run
    ("x" * 10_000_000, 0.0),                                              # 10 MB completion
]


@pytest.mark.parametrize(("completion", "expected"), CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_known_answers(completion: str, expected: float, sandbox_mode: str) -> None:
    started = time.monotonic()
    assert env_for(sandbox_mode).reward(TASK, completion) == expected
    assert time.monotonic() - started < 30
    assert not MARKER.exists()


def test_table_size() -> None:
    assert len(CASES) >= 30


def test_forged_results_cannot_exceed_what_is_correct() -> None:
    # The child never sees expected outputs: a forged line only helps when it is already right
    # (the table forges the correct 3 for test 0); a wrong one costs its test and shifts the rest.
    assert ENV.reward(TASK, fenced("import os\nos.write(3, b'{\"i\": 1, \"value\": 99}\\n')\n"
                                   "def add(a, b):\n    return a + b")) == 0.0


def test_reference_solutions_pass_and_generated_tasks_are_graded() -> None:
    for task in ENV.sample(11, 25):
        assert ENV.reward(task, fenced(task.answer)) == 1.0, task.question()
        assert ENV.reward(task, fenced(f"def {task.info['entry_point']}(*a):\n    return None")) < 1.0


def test_isolation_layers_reported(sandbox_mode: str) -> None:
    result = run_sandboxed("import os\ndef f():\n    return [os.getcwd(), os.listdir('.')]", "f", [[]],
                           LIMITS.model_copy(update={"isolation": sandbox_mode}))
    layers = result.isolation
    assert layers["mode"] == sandbox_mode and layers["rlimits"] and layers["audit"]
    assert layers["seccomp"] is (os.uname().machine in ("x86_64", "aarch64"))
    assert result.values[0]["value"][1] == []  # type: ignore[index]
    if sandbox_mode == "namespaces":
        assert layers["netns"] and layers["pidns"] and layers["proc"] and layers["root"] == "private"
    if sandbox_mode != "none":  # a uid of its own: neither root nor the grader's user
        assert layers["uid"] not in (0, os.getuid())


def test_private_root_holds_only_the_interpreter() -> None:
    skip_unless_mode("namespaces")
    repo = str(Path(environments.__file__).resolve().parents[1])
    code = (f"import os\ndef f():\n    return [os.path.exists({repo + '/environments'!r}), "
            "os.listdir('/tmp'), os.path.exists('/root/.ssh'), os.listdir('/etc'), "
            "sorted(p for p in os.listdir('/proc') if p.isdigit())]")
    result = run_sandboxed(code, "f", [[]], LIMITS.model_copy(update={"isolation": "namespaces"}))
    # No repository, no home, an empty /etc, and a /proc listing the candidate alone (PID 1).
    assert result.values[0] == {"value": [False, ["sandbox-work"], False, [], ["1"]]}
    assert set(result.isolation["visible"]) <= {"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64",
                                                "/libx32", os.path.realpath(sys.base_prefix)}


def test_processes_are_gone_after_a_timeout(sandbox_mode: str) -> None:
    result = run_sandboxed("import time\ndef f():\n    time.sleep(30)", "f", [[]],
                           SandboxLimits(wall_s=1.0, cpu_s=1, isolation=sandbox_mode))
    assert result.fatal == "timeout" and result.values[0] == {"error": "missing"}
    assert result.wall_s < 10
    if sandbox_mode != "none":
        assert candidate_processes(result.isolation["uid"]) == []


def test_extract_code_rules() -> None:
    assert extract_code("```python\nA\n```") == "A"
    assert extract_code("text ```\nB\n``` more ```python\nC\n```") == "C"
    assert extract_code("no fences") == "no fences"


@pytest.mark.parametrize(("expected", "got", "same"), [
    (3, 3, True), (3, 3.0, True), (0.1 + 0.2, 0.3, True), (True, 1, False), (1, True, False),
    ([1, [2]], [1, [2]], True), ([1], [1, 2], False), ({"a": 1}, {"a": 1}, True), (None, None, True),
    ("a", "a", True), (None, 0, False),
])
def test_same_value(expected: object, got: object, same: bool) -> None:
    assert same_value(expected, got) is same


@pytest.mark.parametrize(("code", "expected"), [
    ("import os\ndef f():\n    return os.fork()", {"error": "PermissionError"}),
    ("import subprocess\ndef f():\n    return subprocess.run(['true']).returncode", {"error": "PermissionError"}),
    ("import socket\ndef f():\n    return socket.socket()", {"error": "PermissionError"}),
    (f"def f():\n    return open({str(MARKER)!r}, 'w').write('x')", {"error": "PermissionError"}),
    ("import os\ndef f():\n    return os.remove('/etc/hostname')", {"error": "PermissionError"}),
    ("def f():\n    return len(bytearray(2**30))", {"error": "MemoryError"}),
    ("def f():\n    open('big', 'w').write('x' * (2 * 2**20))", {"error": "OSError"}),
    ("def f():\n    open('ok', 'w').write('x')\n    return open('ok').read()", {"value": "x"}),
])
def test_fallback_layers(code: str, expected: dict[str, object]) -> None:
    """Without namespaces (root in a default container): a uid of its own, rlimits, the audit hook."""
    skip_unless_mode("uid")
    result = run_sandboxed(code, "f", [[]], SandboxLimits(wall_s=3.0, cpu_s=1, memory_bytes=256 * 2**20,
                                                          isolation="uid"))
    assert result.isolation["netns"] is False and result.isolation["audit"] is True
    assert result.values[0] == expected
    assert not MARKER.exists()


@pytest.mark.parametrize("answer", [
    "not json", "[]", "{}", json.dumps({"entry_point": "f", "tests": []}),
    json.dumps({"entry_point": "not an identifier", "tests": [{"args": [], "expected": 1}]}),
    json.dumps({"entry_point": "f", "tests": [{"args": 3, "expected": 1}]}),
    json.dumps({"entry_point": "f", "tests": [{"expected": 1}]}),
])
def test_bad_code_spec_is_typed(answer: str) -> None:
    with pytest.raises(environments.registry.TaskEnvironmentError):
        ENV.task_from("Write f.", answer)
