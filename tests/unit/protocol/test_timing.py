"""protocol.timing: the stage-timing hook benchmarks read (exclusive times, thread-safe, a no-op without a timer)."""

from __future__ import annotations

import threading
import time

from protocol.timing import StageTimer, stage


def test_nested_stages_are_charged_to_their_own_label_only() -> None:
    timer = StageTimer()
    t0 = time.perf_counter()
    with timer.stage("outer"):
        time.sleep(0.02)
        with timer.stage("inner"):
            time.sleep(0.05)
        with timer.stage("inner"):
            pass
    wall = time.perf_counter() - t0
    assert timer.calls == {"outer": 1, "inner": 2}
    assert timer.times["inner"] >= 0.05
    # exclusive: outer is not charged inner's sleep, so the labels add up to at most the wall time
    assert timer.times["outer"] <= wall - 0.05
    assert timer.times["outer"] >= 0.02
    assert 0.07 <= timer.total() <= wall


def test_a_stage_that_raises_is_still_timed_and_the_nesting_recovers() -> None:
    timer = StageTimer()
    try:
        with timer.stage("fails"):
            raise ValueError("boom")
    except ValueError:
        pass
    with timer.stage("after"):
        pass
    assert timer.calls == {"fails": 1, "after": 1}


def test_threads_nest_their_own_stages() -> None:
    timer = StageTimer()
    start = threading.Barrier(2)

    def work(label: str) -> None:
        start.wait()
        for _ in range(200):
            with timer.stage(label), timer.stage(label + ".inner"):
                pass

    threads = [threading.Thread(target=work, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert timer.calls == {"a": 200, "a.inner": 200, "b": 200, "b.inner": 200}
    assert all(v >= 0.0 for v in timer.times.values())


def test_without_a_timer_a_stage_is_a_no_op() -> None:
    with stage(None, "anything"):
        pass
    timer = StageTimer()
    with stage(timer, "x"):
        pass
    assert timer.calls == {"x": 1}
