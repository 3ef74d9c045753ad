"""Bans remembered across pulls: expiry, atomic writes, and a corrupt file that is ignored, not fatal."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from protocol.errors import RelayError
from shardcast.bans import BanList
from shardcast.sources import SourceBoard

A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


def test_a_ban_is_remembered_and_applied_to_a_new_board(tmp_path: Path) -> None:
    bans = BanList(tmp_path / "bans.json", duration_s=3600)
    board = SourceBoard([A, B])
    board.ban(board.sources[A], "shard 3 of v1: hash 00… != ab…")
    bans.record(board)
    doc = json.loads((tmp_path / "bans.json").read_text())
    assert set(doc) == {A} and doc[A]["until"] > time.time() + 3500

    fresh = SourceBoard([A, B])
    assert bans.apply(fresh) == [A]
    assert fresh.sources[A].banned and "earlier pull" in (fresh.sources[A].ban_reason or "")
    assert "shard 3 of v1" in (fresh.sources[A].ban_reason or "")
    assert not fresh.sources[B].banned
    assert fresh.pick() is fresh.sources[B]


def test_an_earlier_ban_keeps_its_expiry(tmp_path: Path) -> None:
    path = tmp_path / "bans.json"
    path.write_text(json.dumps({A: {"reason": "old", "until": time.time() + 60}}))
    bans = BanList(path, duration_s=3600)
    board = SourceBoard([A, B])
    bans.apply(board)
    board.ban(board.sources[B], "bad manifest")
    bans.record(board)
    doc = json.loads(path.read_text())
    assert doc[A]["until"] < time.time() + 61 and doc[A]["reason"] == "old"
    assert doc[B]["until"] > time.time() + 3500


def test_expired_bans_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "bans.json"
    path.write_text(json.dumps({A: {"reason": "long ago", "until": time.time() - 1}}))
    board = SourceBoard([A])
    assert BanList(path).apply(board) == []
    assert not board.sources[A].banned


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'{"http://x": 5}', b'{"http://x": {"until": "soon"}}',
                                     b"\xff\xfe"])
def test_a_corrupt_file_is_ignored_and_rewritten(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bans.json"
    path.write_bytes(content)
    bans = BanList(path)
    board = SourceBoard([A, B])
    assert bans.apply(board) == []
    board.ban(board.sources[A], "bad bytes")
    bans.record(board)
    assert set(json.loads(path.read_text())) == {A}


def test_an_oversized_file_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "bans.json"
    path.write_text(json.dumps({A: {"reason": "x" * (5 << 20), "until": time.time() + 60}}))
    board = SourceBoard([A])
    assert BanList(path).apply(board) == []


def test_duration_zero_remembers_nothing(tmp_path: Path) -> None:
    bans = BanList(tmp_path / "bans.json", duration_s=0)
    board = SourceBoard([A])
    board.ban(board.sources[A], "bad")
    bans.record(board)
    assert not (tmp_path / "bans.json").exists()


def test_every_source_banned_says_why(tmp_path: Path) -> None:
    path = tmp_path / "bans.json"
    path.write_text(json.dumps({A: {"reason": "forged manifest", "until": time.time() + 60}}))
    board = SourceBoard([A])
    BanList(path).apply(board)
    with pytest.raises(RelayError, match="forged manifest"):
        board.pick()


def test_a_long_running_holder_lifts_bans_that_ran_out(tmp_path: Path) -> None:
    """A relay runs for weeks: bans it applied (from the file) or recorded run out while it runs."""
    path = tmp_path / "bans.json"
    # bans of a second: the steps before "nothing ran out yet" take milliseconds, even on a loaded machine
    # (0.2 s did not always do)
    path.write_text(json.dumps({A: {"reason": "old", "until": time.time() + 1.0}}))
    bans = BanList(path, duration_s=1.0)
    board = SourceBoard([A, B])
    assert bans.apply(board) == [A]
    board.ban(board.sources[B], "forged manifest")
    bans.record(board)
    assert bans.lift_expired(board) == []  # nothing ran out yet
    expires = bans.expires(B)
    assert expires is not None and expires > time.time()
    lifted: list[str] = []
    deadline = time.monotonic() + 30
    while len(lifted) < 2:  # each is lifted once its time has run out, by a later call
        assert time.monotonic() < deadline, lifted
        time.sleep(0.05)
        lifted += bans.lift_expired(board)
    assert sorted(lifted) == [A, B]
    assert not board.sources[A].banned and not board.sources[B].banned
    assert bans.expires(A) is None and bans.lift_expired(board) == []


def test_a_ban_list_that_cannot_be_written_still_bans_for_this_process(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("x")
    bans = BanList(tmp_path / "file" / "bans.json")
    board = SourceBoard([A])
    board.ban(board.sources[A], "bad bytes")
    bans.record(board)  # no exception: the ban holds in memory
    assert board.sources[A].banned and "cannot remember bans" in caplog.text
