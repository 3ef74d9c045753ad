"""Seeds and work keys: pinned known answers, the documented encoding, normalisation and domain separation."""

from __future__ import annotations

import hashlib

import pytest

from protocol.errors import ProtocolError, SignatureError
from protocol.seeds import env_seed, sampling_seed, task_seed, work_key

ADDR = "0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266"  # anvil dev account #0 (public)
POOL = "0x5FbDB2315678afecb367f032d93F642f64180aa3"  # the first contract anvil account #0 deploys
OTHER_POOL = "0xe7f1725E7734CE288F8367e1Bb143E90bb3F0512"  # its second
AT = {"run_id": "r", "chain_id": 31337, "pool": POOL}


def test_known_answers() -> None:
    # Pinned: a change here breaks agreement between nodes and validators of different builds.
    v = {"chain_id": 31337, "pool": POOL}
    assert task_seed(ADDR, 0, 0, run_id="run-1", **v) == 7778259335063926539
    assert task_seed(ADDR, 7, 3, run_id="run-1", **v) == 527660934271034835
    assert task_seed(ADDR, 7, 3, run_id="run-2", **v) == 8777408617193418030
    assert task_seed(ADDR, 7, 3, run_id="run-1", chain_id=1, pool=POOL) == 3821348356396396840
    assert sampling_seed(ADDR, 7, "gsm8k:12", 0, run_id="run-1", counter=3, **v) == 3632497214133513096
    assert sampling_seed(ADDR, 7, 12, 1, run_id="run-1", counter=3, **v) == 7279611965153137106
    assert work_key("run-1", ADDR, 7, 3, **v).hex() == "5f4537dd1a881459d919a054831ac41f8cab54089ddf8cb04ddfd5a5ee8eda18"


def _text(s: str) -> bytes:
    b = s.encode()
    return b"\x03" + len(b).to_bytes(4, "big") + b


def _uint(n: int) -> bytes:
    return b"\x02" + n.to_bytes(8, "big")


def _addr(a: str) -> bytes:
    return b"\x01" + bytes.fromhex(a[2:])


def test_matches_documented_encoding() -> None:
    # An independent re-implementation of the encoding written in the module docstring.
    fields = _uint(31337) + _addr(POOL) + _text("run-1") + _addr(ADDR) + _uint(7) + _uint(3)
    key = hashlib.sha256(b"prime/work-key/v2\x00" + fields).digest()
    assert work_key("run-1", ADDR, 7, 3, chain_id=31337, pool=POOL) == key
    expected = int.from_bytes(hashlib.sha256(b"prime/task-seed/v2\x00" + fields).digest()[:8], "big") >> 1
    assert task_seed(ADDR, 7, 3, run_id="run-1", chain_id=31337, pool=POOL) == expected
    msg = b"prime/sampling-seed/v2\x00" + b"\x04" + key + _text("gsm8k:12") + _uint(0)
    expected = int.from_bytes(hashlib.sha256(msg).digest()[:8], "big") >> 1
    assert sampling_seed(ADDR, 7, "gsm8k:12", 0, run_id="run-1", chain_id=31337, pool=POOL, counter=3) == expected


def test_address_case_does_not_matter() -> None:
    for variant in (ADDR.lower(), "0x" + ADDR[2:].upper()):
        assert task_seed(variant, 1, 2, **AT) == task_seed(ADDR, 1, 2, **AT)
        assert sampling_seed(variant, 1, "t", 2, counter=0, **AT) == sampling_seed(ADDR, 1, "t", 2, counter=0, **AT)
        assert work_key("r", ADDR, 1, 2, chain_id=1, pool=POOL.lower()) == work_key("r", ADDR, 1, 2, chain_id=1,
                                                                                     pool=POOL)


def test_range_and_spread() -> None:
    seeds = {task_seed(ADDR, v, c, **AT) for v in range(20) for c in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)
    assert max(seeds) > 2**62  # uses the top bit of the 63


def test_fields_are_separated() -> None:
    base = sampling_seed(ADDR, 1, 5, 0, counter=0, **AT)
    assert sampling_seed(ADDR, 1, "5", 0, counter=0, **AT) != base  # int and str task ids differ
    assert sampling_seed(ADDR, 1, 5, 1, counter=0, **AT) != base
    assert sampling_seed(ADDR, 2, 5, 0, counter=0, **AT) != base
    assert sampling_seed(ADDR, 1, 5, 0, counter=0, **{**AT, "run_id": "r2"}) != base
    other = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"  # anvil dev account #1
    assert sampling_seed(other, 1, 5, 0, counter=0, **AT) != base
    # Same numbers, different purpose: task and sampling seeds never coincide by construction.
    assert task_seed(ADDR, 1, 5, **AT) != sampling_seed(ADDR, 1, 5, 0, counter=0, **AT)


def test_the_same_task_drawn_again_is_sampled_afresh() -> None:
    # Issue 23 item 5: the sampling seed binds the work key, so a task a node draws at two counters of one
    # version is sampled with unrelated seeds (a cached answer is never the right one).
    assert sampling_seed(ADDR, 1, "t", 0, counter=0, **AT) != sampling_seed(ADDR, 1, "t", 0, counter=1, **AT)


def test_chain_and_pool_are_bound() -> None:
    # Issue 23 item 7: the same run id, node, version and counter in a second pool or on another chain is
    # another assignment: another work key, other tasks, other sampling seeds.
    elsewhere = [{**AT, "pool": OTHER_POOL}, {**AT, "chain_id": 1}]
    for at in elsewhere:
        assert work_key("r", ADDR, 1, 2, chain_id=at["chain_id"], pool=at["pool"]) != \
            work_key("r", ADDR, 1, 2, chain_id=31337, pool=POOL)
        assert task_seed(ADDR, 1, 2, **at) != task_seed(ADDR, 1, 2, **AT)
        assert sampling_seed(ADDR, 1, "t", 0, counter=2, **at) != sampling_seed(ADDR, 1, "t", 0, counter=2, **AT)


@pytest.mark.parametrize(
    "args",
    [(-1, 0), (0, -1), (2**64, 0), (True, 0), (1.0, 0), ("1", 0)],
)
def test_bad_integers(args: tuple[object, object]) -> None:
    with pytest.raises(ProtocolError):
        task_seed(ADDR, args[0], args[1], **AT)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        work_key("r", ADDR, 0, 0, chain_id=args[1] if args[0] == 0 else args[0], pool=POOL)  # type: ignore[arg-type]


def test_bad_address() -> None:
    with pytest.raises(SignatureError):
        task_seed("0x1234", 0, 0, **AT)
    with pytest.raises(SignatureError):
        work_key("r", ADDR, 0, 0, chain_id=1, pool="0x1234")


def test_env_seed_known_answers_and_encoding() -> None:
    v = {"run_id": "run-1", "chain_id": 31337, "pool": POOL, "counter": 3}
    assert env_seed(ADDR, 7, "gsm8k:12", **v) == 4181194745602026549
    assert env_seed(ADDR, 7, 12, **v) == 8782314946038455902
    key = work_key("run-1", ADDR, 7, 3, chain_id=31337, pool=POOL)
    digest = hashlib.sha256(b"prime/env-seed/v1\x00" + b"\x04" + key + _text("gsm8k:12")).digest()
    assert env_seed(ADDR, 7, "gsm8k:12", **v) == int.from_bytes(digest[:8], "big") >> 1


def test_env_seed_is_one_per_task_and_bound_to_the_assignment() -> None:
    base = env_seed(ADDR, 1, "t", counter=0, **AT)
    assert env_seed(ADDR, 1, "u", counter=0, **AT) != base
    assert env_seed(ADDR, 1, "t", counter=1, **AT) != base  # another counter: another environment draw
    assert env_seed(ADDR, 1, "t", counter=0, **{**AT, "pool": OTHER_POOL}) != base
    # its own tag: never the sampler's randomness of any sample of the task
    assert base not in {sampling_seed(ADDR, 1, "t", i, counter=0, **AT) for i in range(8)}
