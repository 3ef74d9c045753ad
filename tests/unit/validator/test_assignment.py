"""Issue 35 item 4: a validator covering for a down peer continues a node's counters from what the pool knows
(the chain's frontier for that node and version), never from a first counter the node picks."""

from __future__ import annotations

from typing import Any, cast

from protocol.identity import checksum
from protocol.rollout import RunSpec
from validator.assignment import Assignment, CounterOutOfOrderError
from validator.ledger import Ledger
from validator.stats import Stats

RUN = RunSpec(run_id="r", env="reverse-text", env_version="1")
POOL = "0x" + "22" * 20
ME, PEER = "0x" + "aa" * 20, "0x" + "bb" * 20
NODE = "0x" + "cc" * 20


class SeenKeys:
    """The one chain read the counter check makes: which work keys the pool has seen."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def work_known(self, key: bytes) -> bool:
        return key in self.keys


class Sub:
    def __init__(self, counter: int, version: int) -> None:
        self.node, self.policy_version, self.counter = NODE, version, counter


def test_a_covering_validator_continues_from_the_chains_frontier_not_a_chosen_counter(ledger: Ledger) -> None:
    chain = SeenKeys()
    a = Assignment(RUN, chain_id=1, pool=POOL, me=ME, validators=[ME, PEER], ledger=ledger,
                   chain=cast(Any, chain), stats=Stats(), counter_gap=0)
    version = next(v for v in range(1, 100) if a.first(NODE, v) == checksum(PEER))  # we cover for PEER at this version
    for c in range(3):  # the peer took and reported counters 0..2
        chain.keys.add(a.work_key(NODE, version, c))
    problem = a.counter_problem(cast(Any, Sub(228, version)))  # a hand-picked first counter
    assert isinstance(problem, CounterOutOfOrderError) and problem.expected == 3
    assert a.counter_problem(cast(Any, Sub(3, version))) is None
