"""Deterministic seeds that a node and a validator compute independently and must agree on.

A node cannot pick its own prompts or its own sampling randomness: both come from a hash of values
fixed by the protocol (the node's address, the policy version, a counter or task id, and the run).
A validator recomputes them to check that the node answered the task it was assigned and sampled
every token with the seed it was given.

Encoding (version 1, pinned by known-answer tests): SHA-256 over

    tag || 0x00 || field_1 || field_2 || ...

where `tag` is an ASCII purpose string (`prime/task-seed/v1`, `prime/sampling-seed/v1`) and each
field is type-tagged so different field types can never produce the same bytes:

    0x01 || 20 raw address bytes                   (addresses, so letter case never matters)
    0x02 || uint64 big-endian                      (non-negative integers below 2**64)
    0x03 || uint32 big-endian length || UTF-8      (strings)

The seed is the first 8 digest bytes read big-endian, shifted right by one: a 63-bit non-negative
integer, safe as a signed 64-bit value (torch generators, SQLite, Java/Go peers).
"""

from __future__ import annotations

import hashlib

from protocol.errors import ProtocolError
from protocol.identity import checksum

SEED_BITS = 63
_U64 = 2**64
_U32 = 2**32


def _address(value: str) -> bytes:
    return b"\x01" + bytes.fromhex(checksum(value)[2:])


def _uint(value: int, name: str) -> bytes:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value < _U64:
        raise ProtocolError(f"{name} must be in [0, 2**64), got {value}")
    return b"\x02" + value.to_bytes(8, "big")


def _text(value: str, name: str) -> bytes:
    if not isinstance(value, str):
        raise ProtocolError(f"{name} must be a str, got {type(value).__name__}")
    data = value.encode("utf-8")
    if len(data) >= _U32:
        raise ProtocolError(f"{name} is too long")
    return b"\x03" + len(data).to_bytes(4, "big") + data


def _task_id(value: int | str) -> bytes:
    if isinstance(value, str):
        return _text(value, "task_id")
    return _uint(value, "task_id")


def _seed(tag: bytes, *fields: bytes) -> int:
    digest = hashlib.sha256(tag + b"\x00" + b"".join(fields)).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)


def task_seed(node_address: str, policy_version: int, counter: int, *, run_id: str) -> int:
    """The seed from which the environment builds the `counter`-th task batch of a node at a version.

    `run_id` separates training runs (and networks): the same node, version and counter give an
    unrelated seed in another run.
    """
    return _seed(
        b"prime/task-seed/v1",
        _text(run_id, "run_id"),
        _address(node_address),
        _uint(policy_version, "policy_version"),
        _uint(counter, "counter"),
    )


def sampling_seed(
    node_address: str, policy_version: int, task_id: int | str, sample_index: int, *, run_id: str
) -> int:
    """The seed of the sampler for sample `sample_index` of task `task_id` (ints and strings differ)."""
    return _seed(
        b"prime/sampling-seed/v1",
        _text(run_id, "run_id"),
        _address(node_address),
        _uint(policy_version, "policy_version"),
        _task_id(task_id),
        _uint(sample_index, "sample_index"),
    )


def _digest(tag: bytes, *fields: bytes) -> bytes:
    return hashlib.sha256(tag + b"\x00" + b"".join(fields)).digest()


def work_key(run_id: str, node_address: str, policy_version: int, counter: int) -> bytes:
    """The 32-byte key of one assignment: the `counter`-th batch of `node` at `policy_version`.

    It is derived from the assignment, never from the payload, so one assignment is paid at most
    once (the pool contract keys work by it) whichever validator sees it and however the payload is
    varied. Same field encoding as the seeds above, tag `prime/work-key/v1`, full SHA-256 digest.
    """
    return _digest(
        b"prime/work-key/v1",
        _text(run_id, "run_id"),
        _address(node_address),
        _uint(policy_version, "policy_version"),
        _uint(counter, "counter"),
    )


def validator_ranking(run_id: str, node_address: str, policy_version: int, validators: list[str]) -> list[str]:
    """`validators` in the order they take `node`'s work at `policy_version` (rendezvous hashing).

    Every validator address gets the score SHA-256(tag, run, node, version, validator); the highest
    is the assigned validator, the next one takes over while the first is down, and so on.
    Deterministic from the announced set, so a node cannot shop for a lax validator; adding or
    removing one validator moves only the nodes it wins or loses. Checksummed addresses.
    """
    if not validators:
        raise ProtocolError("no validators announced for this run")
    head = (
        _text(run_id, "run_id")
        + _address(node_address)
        + _uint(policy_version, "policy_version")
    )
    return sorted(
        {checksum(v) for v in validators},
        key=lambda v: _digest(b"prime/validator-rendezvous/v1", head, _address(v)),
        reverse=True,
    )


def assigned_validator(run_id: str, node_address: str, policy_version: int, validators: list[str]) -> str:
    """Which of `validators` checks `node`'s work at `policy_version`: the first of `validator_ranking`."""
    return validator_ranking(run_id, node_address, policy_version, validators)[0]
