"""Deterministic seeds that a node and a validator compute independently and must agree on.

A node cannot pick its own prompts or its own sampling randomness: both come from a hash of values
fixed by the protocol. An *assignment* is (chain id, pool, run, node, policy version, counter): the
`counter`-th batch of a node at a version, in one pool contract on one chain. Its **work key** names
it (the pool pays a work key at most once), its **task seed** draws its tasks, and each sample's
**sampling seed** is derived from the work key, so two assignments (another counter, another pool,
another chain) never share a sample's randomness. A validator recomputes all three to check that the
node answered the task it was assigned and sampled every token with the seed it was given.

Encoding (version 3, pinned by known-answer tests; other implementations follow it byte for byte):
SHA-256 over

    tag || 0x00 || field_1 || field_2 || ...

where `tag` is an ASCII purpose string and each field is type-tagged so different field types can
never produce the same bytes:

    0x01 || 20 raw address bytes                   (addresses, so letter case never matters)
    0x02 || uint64 big-endian                      (non-negative integers below 2**64)
    0x03 || uint32 big-endian length || UTF-8      (strings)
    0x04 || 32 raw bytes                           (a digest: the work key, a manifest hash)

The derivations (fields in this order):

    work_key      = SHA-256("prime/work-key/v2"      0x00  uint chain_id, address pool, text run_id,
                                                           address node, uint policy_version, uint counter)
    task_seed     = seed("prime/task-seed/v3"        0x00  the same six fields as the work key,
                                                           digest manifest_hash of the version on chain)
    sampling_seed = seed("prime/sampling-seed/v3"    0x00  digest work_key, digest manifest_hash,
                                                           task_id, uint sample_index)
    env_seed      = seed("prime/env-seed/v1"         0x00  digest work_key, digest manifest_hash, task_id)

with `task_id` a uint64 field for an int and a text field for a str. A seed is the first 8 digest
bytes read big-endian, shifted right by one: a 63-bit non-negative integer, safe as a signed 64-bit
value (torch generators, SQLite, Java/Go peers). The work key is the full 32-byte digest.

The environment seed of a multi-turn episode (a game's hidden word, a scripted user's draws) is one per
(work key, task), not per sample: the samples of a task form one GRPO group, and a group whose members
met different environments would compare the environment's luck, not the policy's turns. The node
cannot choose it (the work key is fixed by the assignment) nor re-draw it (counters are used in order).

Version 1 bound (run, node, version, counter) only: the same work was payable in a second pool with
the same run id, and a task drawn twice by one node within a version repeated its samples exactly
(a cached answer earned full pay). Version 2 binds chain and pool everywhere and the counter into
every sampling seed. Version 3 mixes the version's manifest hash as the chain records it
(`publishPolicy(version, manifestHash)`) into the task and the sampling seeds: nobody knows it before the
version is published, so keys ground beforehand can predict neither their tasks nor their sampling there
(docs/protocol/assignment.md, "Grinding"); the work key does not need it (it names the assignment, it draws
nothing). The validator rendezvous (`validator_ranking`) is unchanged (`.../v1`).
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


def _digest32(value: bytes, name: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != 32:
        raise ProtocolError(f"{name} must be 32 bytes")
    return b"\x04" + value


def _digest(tag: bytes, *fields: bytes) -> bytes:
    return hashlib.sha256(tag + b"\x00" + b"".join(fields)).digest()


def _seed(tag: bytes, *fields: bytes) -> int:
    return int.from_bytes(_digest(tag, *fields)[:8], "big") >> (64 - SEED_BITS)


def _assignment(chain_id: int, pool: str, run_id: str, node_address: str, policy_version: int,
                counter: int) -> bytes:
    """The six fields that name one assignment, in the order the module docstring gives."""
    return (_uint(chain_id, "chain_id") + _address(pool) + _text(run_id, "run_id") + _address(node_address)
            + _uint(policy_version, "policy_version") + _uint(counter, "counter"))


def work_key(run_id: str, node_address: str, policy_version: int, counter: int, *, chain_id: int,
             pool: str) -> bytes:
    """The 32-byte key of one assignment: the `counter`-th batch of `node` at `policy_version` in the pool
    contract `pool` on chain `chain_id`.

    It is derived from the assignment, never from the payload, so one assignment is paid at most
    once (the pool contract keys work by it) whichever validator sees it and however the payload is
    varied; the same run id in another pool or on another chain gives unrelated keys.
    """
    return _digest(b"prime/work-key/v2", _assignment(chain_id, pool, run_id, node_address, policy_version, counter))


def task_seed(node_address: str, policy_version: int, counter: int, *, run_id: str, chain_id: int,
              pool: str, manifest_hash: bytes) -> int:
    """The seed from which the environment builds the `counter`-th task batch of a node at a version.

    Bound to the whole assignment (chain, pool, run) and to the version's `manifest_hash` as the chain
    records it (`publishPolicy(version, manifestHash)`): nobody knows it before the version is published,
    so a key ground beforehand cannot predict its tasks there (docs/protocol/assignment.md, "Grinding").
    """
    return _seed(b"prime/task-seed/v3", _assignment(chain_id, pool, run_id, node_address, policy_version, counter),
                 _digest32(manifest_hash, "manifest_hash"))


def sampling_seed(
    node_address: str, policy_version: int, task_id: int | str, sample_index: int, *, run_id: str, chain_id: int,
    pool: str, counter: int, manifest_hash: bytes,
) -> int:
    """The seed of the sampler for sample `sample_index` of task `task_id` (ints and strings differ) in
    assignment `counter`: derived from the assignment's work key, so a task drawn again by the same
    node at the same version (another counter) is sampled afresh, never replayed from a cache; and from the
    version's `manifest_hash` as the chain records it, so no key ground before the version is published can
    know its sampling draws there (docs/protocol/assignment.md, "Grinding")."""
    key = work_key(run_id, node_address, policy_version, counter, chain_id=chain_id, pool=pool)
    return _seed(b"prime/sampling-seed/v3", _digest32(key, "work_key"), _digest32(manifest_hash, "manifest_hash"),
                 _task_id(task_id), _uint(sample_index, "sample_index"))


def env_seed(
    node_address: str, policy_version: int, task_id: int | str, *, run_id: str, chain_id: int, pool: str,
    counter: int, manifest_hash: bytes,
) -> int:
    """The seed a multi-turn environment plays task `task_id` of assignment `counter` from (one per task:
    every sample of the task meets the same environment; see the module docstring), mixing the version's
    `manifest_hash` as the chain records it like the task and sampling seeds (no key ground before the version
    is published can know what its environments will do)."""
    key = work_key(run_id, node_address, policy_version, counter, chain_id=chain_id, pool=pool)
    return _seed(b"prime/env-seed/v1", _digest32(key, "work_key"), _digest32(manifest_hash, "manifest_hash"),
                 _task_id(task_id))


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
