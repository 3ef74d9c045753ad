"""Seeds and work keys: pinned known answers, the documented encoding, normalisation and domain separation."""

from __future__ import annotations

import hashlib

import pytest

from protocol.errors import ProtocolError, SignatureError
from protocol.seeds import env_seed, sampling_seed, task_seed, work_key

ADDR = "0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266"  # anvil dev account #0 (public)
POOL = "0x5FbDB2315678afecb367f032d93F642f64180aa3"  # the first contract anvil account #0 deploys
OTHER_POOL = "0xe7f1725E7734CE288F8367e1Bb143E90bb3F0512"  # its second
MANIFEST = hashlib.sha256(b"manifest v7").digest()  # what publishPolicy recorded for the version
AT = {"run_id": "r", "chain_id": 31337, "pool": POOL}
TASK = {**AT, "manifest_hash": MANIFEST}


def test_known_answers() -> None:
    # Pinned: a change here breaks agreement between nodes and validators of different builds.
    v = {"chain_id": 31337, "pool": POOL}
    assert task_seed(ADDR, 0, 0, run_id="run-1", manifest_hash=MANIFEST, **v) == 7715434048979640825
    assert task_seed(ADDR, 7, 3, run_id="run-1", manifest_hash=MANIFEST, **v) == 4085103335309757024
    assert task_seed(ADDR, 7, 3, run_id="run-2", manifest_hash=MANIFEST, **v) == 2621072763221337741
    assert task_seed(ADDR, 7, 3, run_id="run-1", chain_id=1, pool=POOL, manifest_hash=MANIFEST) == 1969476936201023534
    assert sampling_seed(ADDR, 7, "gsm8k:12", 0, run_id="run-1", counter=3, manifest_hash=MANIFEST, **v) == 7731083329742626080
    assert sampling_seed(ADDR, 7, 12, 1, run_id="run-1", counter=3, manifest_hash=MANIFEST, **v) == 8464355764146964275
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
    expected = int.from_bytes(hashlib.sha256(b"prime/task-seed/v3\x00" + fields + b"\x04" + MANIFEST).digest()[:8],
                              "big") >> 1
    assert task_seed(ADDR, 7, 3, run_id="run-1", chain_id=31337, pool=POOL, manifest_hash=MANIFEST) == expected
    msg = b"prime/sampling-seed/v3\x00" + b"\x04" + key + b"\x04" + MANIFEST + _text("gsm8k:12") + _uint(0)
    expected = int.from_bytes(hashlib.sha256(msg).digest()[:8], "big") >> 1
    assert sampling_seed(ADDR, 7, "gsm8k:12", 0, run_id="run-1", chain_id=31337, pool=POOL, counter=3,
                         manifest_hash=MANIFEST) == expected


def test_address_case_does_not_matter() -> None:
    for variant in (ADDR.lower(), "0x" + ADDR[2:].upper()):
        assert task_seed(variant, 1, 2, **TASK) == task_seed(ADDR, 1, 2, **TASK)
        assert sampling_seed(variant, 1, "t", 2, counter=0, **TASK) == sampling_seed(ADDR, 1, "t", 2, counter=0, **TASK)
        assert work_key("r", ADDR, 1, 2, chain_id=1, pool=POOL.lower()) == work_key("r", ADDR, 1, 2, chain_id=1,
                                                                                     pool=POOL)


def test_range_and_spread() -> None:
    seeds = {task_seed(ADDR, v, c, **TASK) for v in range(20) for c in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)
    assert max(seeds) > 2**62  # uses the top bit of the 63


def test_fields_are_separated() -> None:
    base = sampling_seed(ADDR, 1, 5, 0, counter=0, **TASK)
    assert sampling_seed(ADDR, 1, "5", 0, counter=0, **TASK) != base  # int and str task ids differ
    assert sampling_seed(ADDR, 1, 5, 1, counter=0, **TASK) != base
    assert sampling_seed(ADDR, 2, 5, 0, counter=0, **TASK) != base
    assert sampling_seed(ADDR, 1, 5, 0, counter=0, **{**TASK, "run_id": "r2"}) != base
    other = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"  # anvil dev account #1
    assert sampling_seed(other, 1, 5, 0, counter=0, **TASK) != base
    # Same numbers, different purpose: task and sampling seeds never coincide by construction.
    assert task_seed(ADDR, 1, 5, **TASK) != sampling_seed(ADDR, 1, 5, 0, counter=0, **TASK)


def test_the_same_task_drawn_again_is_sampled_afresh() -> None:
    # Issue 23 item 5: the sampling seed binds the work key, so a task a node draws at two counters of one
    # version is sampled with unrelated seeds (a cached answer is never the right one).
    assert sampling_seed(ADDR, 1, "t", 0, counter=0, **TASK) != sampling_seed(ADDR, 1, "t", 0, counter=1, **TASK)


def test_chain_and_pool_are_bound() -> None:
    # Issue 23 item 7: the same run id, node, version and counter in a second pool or on another chain is
    # another assignment: another work key, other tasks, other sampling seeds.
    elsewhere = [{**AT, "pool": OTHER_POOL}, {**AT, "chain_id": 1}]
    for at in elsewhere:
        assert work_key("r", ADDR, 1, 2, chain_id=at["chain_id"], pool=at["pool"]) != \
            work_key("r", ADDR, 1, 2, chain_id=31337, pool=POOL)
        assert task_seed(ADDR, 1, 2, manifest_hash=MANIFEST, **at) != task_seed(ADDR, 1, 2, **TASK)
        assert sampling_seed(ADDR, 1, "t", 0, counter=2, manifest_hash=MANIFEST, **at) != sampling_seed(ADDR, 1, "t", 0, counter=2, **TASK)


@pytest.mark.parametrize(
    "args",
    [(-1, 0), (0, -1), (2**64, 0), (True, 0), (1.0, 0), ("1", 0)],
)
def test_bad_integers(args: tuple[object, object]) -> None:
    with pytest.raises(ProtocolError):
        task_seed(ADDR, args[0], args[1], **TASK)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        work_key("r", ADDR, 0, 0, chain_id=args[1] if args[0] == 0 else args[0], pool=POOL)  # type: ignore[arg-type]


def test_bad_address() -> None:
    with pytest.raises(SignatureError):
        task_seed("0x1234", 0, 0, **TASK)
    with pytest.raises(SignatureError):
        work_key("r", ADDR, 0, 0, chain_id=1, pool="0x1234")


def test_keys_ground_before_a_version_is_published_cannot_predict_its_tasks() -> None:
    # Issue 35 item 4: a key ground offline for tasks it likes at the next version, under every manifest hash it
    # could guess, draws unrelated tasks once the chain records the real one: the task seed mixes a value nobody
    # knows before publishPolicy, so the best key found beforehand is no better than any other.
    published = hashlib.sha256(b"the manifest the trainer publishes").digest()
    for guess in (bytes(32), MANIFEST, hashlib.sha256(b"the manifest an attacker expects").digest()):
        ground = [task_seed(ADDR, 8, c, **AT, manifest_hash=guess) for c in range(64)]
        drawn = [task_seed(ADDR, 8, c, **AT, manifest_hash=published) for c in range(64)]
        assert not set(ground) & set(drawn)


def test_keys_ground_before_a_version_is_published_cannot_predict_its_sampling() -> None:
    # Issue 35 item 4: the sampling seed mixes the published manifest hash too, so a key ground offline for the
    # sampling draws of the next version (which tokens win where the replay is close) learns nothing about them.
    published = hashlib.sha256(b"the manifest the trainer publishes").digest()
    for guess in (bytes(32), MANIFEST, hashlib.sha256(b"the manifest an attacker expects").digest()):
        ground = {sampling_seed(ADDR, 8, t, i, counter=c, **{**TASK, "manifest_hash": guess})
                  for c in range(8) for t in range(8) for i in range(4)}
        drawn = {sampling_seed(ADDR, 8, t, i, counter=c, **{**TASK, "manifest_hash": published})
                 for c in range(8) for t in range(8) for i in range(4)}
        assert not ground & drawn


def test_env_seed_known_answers_and_encoding() -> None:
    v = {"run_id": "run-1", "chain_id": 31337, "pool": POOL, "counter": 3, "manifest_hash": MANIFEST}
    assert env_seed(ADDR, 7, "gsm8k:12", **v) == 7058586614739854519
    assert env_seed(ADDR, 7, 12, **v) == 3302622544793185946
    key = work_key("run-1", ADDR, 7, 3, chain_id=31337, pool=POOL)
    digest = hashlib.sha256(b"prime/env-seed/v1\x00" + b"\x04" + key + b"\x04" + MANIFEST + _text("gsm8k:12")).digest()
    assert env_seed(ADDR, 7, "gsm8k:12", **v) == int.from_bytes(digest[:8], "big") >> 1


def test_env_seed_is_one_per_task_and_bound_to_the_assignment() -> None:
    base = env_seed(ADDR, 1, "t", counter=0, **TASK)
    assert env_seed(ADDR, 1, "u", counter=0, **TASK) != base
    assert env_seed(ADDR, 1, "t", counter=1, **TASK) != base  # another counter: another environment draw
    assert env_seed(ADDR, 1, "t", counter=0, **{**TASK, "pool": OTHER_POOL}) != base
    # mixes the published manifest hash: no key ground before the version knows what its environments will do
    assert env_seed(ADDR, 1, "t", counter=0, **{**TASK, "manifest_hash": bytes(32)}) != base
    # its own tag: never the sampler's randomness of any sample of the task
    assert base not in {sampling_seed(ADDR, 1, "t", i, counter=0, **TASK) for i in range(8)}
