"""`SourceBoard`'s health: the order of the next pull and which source a shard goes to."""

from __future__ import annotations

import time

from shardcast.sources import SourceBoard


def test_order_puts_hung_last_cooling_after_ready_then_speed_then_versions_served() -> None:
    board = SourceBoard(["http://a", "http://b", "http://c", "http://d", "http://e"])
    a, b, c, d, e = (board.sources[u] for u in ("http://a", "http://b", "http://c", "http://d", "http://e"))
    board.success(a, 1_000_000, 1.0)  # 1 MB/s
    board.success(b, 1_000_000, 1.0)
    b.versions = 3  # as fast as a, served more versions that verified
    board.success(c, 10_000_000, 1.0)  # the fastest, but timed out since
    board.failure(c, timed_out=True)
    board.success(d, 5_000_000, 1.0)
    board.failure(d)  # cooling down
    board.ban(e, "bad shard")
    assert board.order([s.url for s in (a, b, c, d, e)]) == ["http://b", "http://a", "http://d", "http://c"]
    assert c.hung and c.timeouts == 1 and not d.hung


def test_pick_skips_a_hung_source_while_another_is_usable_and_an_answer_clears_it() -> None:
    board = SourceBoard(["http://a", "http://b"])
    a, b = board.sources["http://a"], board.sources["http://b"]
    board.failure(a, timed_out=True)
    a.cooldown_until = b.cooldown_until = 0.0
    assert board.pick() is b and board.pick(exclude={"http://b"}) is b  # never back to the hung one
    board.failure(b, timed_out=True)  # every source hung: nothing else to ask, so they are asked
    a.cooldown_until = b.cooldown_until = time.monotonic() - 1
    assert board.pick() in (a, b)
    board.answered(a)
    assert not a.hung and board.live() == [a]
