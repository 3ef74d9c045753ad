"""Gas per ComputePool call on a real local anvil, against an ERC-20 transfer as the anchor.

    python -m bench.gas [--json PATH] [--quick | --smoke]

`--smoke` (every call once, batches of 2; run by the default test tier so the bench cannot rot) takes
seconds, like the full run.

Every state-changing function is called through the Python client (locally signed transactions) and
its receipt's gasUsed recorded; `ratio` is gas / gas of a plain ERC-20 transfer to a fresh address in
the same run. `ms` is client wall time per transaction (sign, estimate, send, receipt) and depends on
the machine's load. Gas is deterministic for a given compiler build and call sequence.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from eth_utils import keccak

from bench import harness
from contracts.deployment import PoolSettings, deploy_pool
from contracts.devchain import DevChain
from contracts.pool import PoolClient, TokenClient
from contracts.transactor import Receipt, Transactor, connect
from protocol.identity import Identity

TOKEN = 10**18


def main() -> int:
    parser = harness.parser(__doc__, smoke="batches of 2 (checks the bench)",
                            quick="smaller batches (the run takes seconds either way)")
    args = parser.parse_args()
    batch = 2 if args.smoke else 5 if args.quick else 20
    rows: list[dict[str, Any]] = []

    def measure(name: str, fn: Any, items: int = 1) -> Receipt:
        start = time.perf_counter()
        receipt: Receipt = fn()
        ms = (time.perf_counter() - start) * 1000
        rows.append({"call": name, "gas": receipt.gas_used, "items": items,
                     "gas_per_item": receipt.gas_used // items, "ms": round(ms, 2)})
        return receipt

    key_counter = iter(range(1 << 30))

    def key() -> bytes:
        return keccak(text=f"bench-{next(key_counter)}")

    with DevChain.start() as chain:
        url = chain.rpc_url
        admin_id, validator_id, trainer_id, op_id = (chain.account(i) for i in (0, 1, 2, 3))
        admin_tx = Transactor(connect(url), admin_id)
        settings = PoolSettings(min_stake=10 * TOKEN, unbonding_period=300, invalidation_window=100,
                                reward_lock_period=200, reward_per_unit=10**15, slash_penalty=4 * TOKEN,
                                appeal_window=150)
        deployment = deploy_pool(admin_tx, treasury=chain.account(9).address, settings=settings,
                                 mint={op_id.address: 10_000 * TOKEN, admin_id.address: 10_000 * TOKEN})
        admin = PoolClient(connect(url), deployment.pool, admin_id, admin_tx)
        validator = PoolClient(connect(url), deployment.pool, validator_id)
        trainer = PoolClient(connect(url), deployment.pool, trainer_id)
        op = PoolClient(connect(url), deployment.pool, op_id)
        token = TokenClient(connect(url), deployment.token, op_id)

        anchor = measure("ERC20.transfer (anchor)", lambda: token.transfer(Identity.create().address, TOKEN))
        measure("grantRole(VALIDATOR)", lambda: admin.grant_role("validator", validator_id.address))
        measure("grantRole(TRAINER)", lambda: admin.grant_role("trainer", trainer_id.address))
        measure("fundRewards", lambda: admin.fund_rewards(5000 * TOKEN))
        measure("ERC20.approve", lambda: op.token.approve(op.address, 10**30))
        nodes = [Identity.create() for _ in range(3)]
        measure("register", lambda: op.register(nodes[0], settings.min_stake))
        op.register(nodes[1], settings.min_stake)
        op.register(nodes[2], settings.min_stake)
        measure("addStake", lambda: op.add_stake(nodes[0].address, TOKEN))
        first = key()
        measure("recordWork (node's first)", lambda: validator.record_work(nodes[0].address, first, 8))
        keys = [key() for _ in range(4)]
        measure("recordWork", lambda: validator.record_work(nodes[0].address, keys[0], 8))
        for k in keys[1:]:
            validator.record_work(nodes[0].address, k, 8)
        items = [(nodes[0].address, key(), 8) for _ in range(batch)]
        measure(f"recordWorkBatch ({batch})", lambda: validator.record_work_batch(items), items=batch)
        measure(f"recordWorkBatch ({batch}) resent, all skipped", lambda: validator.record_work_batch(items),
                items=batch)
        measure("invalidateSoft", lambda: validator.invalidate_soft(nodes[0].address, keys[3], 2))
        measure("invalidateSoft (never recorded)", lambda: validator.invalidate_soft(nodes[0].address, key(), 2))
        measure("publishPolicy (first)", lambda: trainer.publish_policy(1, keccak(text="m1")))
        measure("publishPolicy", lambda: trainer.publish_policy(2, keccak(text="m2")))
        bad = key()
        validator.record_work(nodes[1].address, bad, 8)
        evidence = keccak(text="evidence")
        measure("invalidateHard (slash+eject)", lambda: validator.invalidate_hard(nodes[1].address, bad, 7, evidence))
        unrecorded = Identity.create()
        op.register(unrecorded, settings.min_stake)
        lost = key()
        measure("invalidateHard (never recorded, slash+eject)",
                lambda: validator.invalidate_hard(unrecorded.address, lost, 7, evidence))
        # appeals: the operator files, a second validator (not the slasher) resolves
        second_id = chain.account(4)
        admin.grant_role("validator", second_id.address)
        second = PoolClient(connect(url), deployment.pool, second_id)
        measure("appeal", lambda: op.appeal(bad))
        measure("resolveAppeal (overturned: stake, work, reinstated)",
                lambda: second.resolve_appeal(bad, False, 0, keccak(text="recheck")))
        op.appeal(lost)
        measure("resolveAppeal (upheld: escrow to treasury)",
                lambda: second.resolve_appeal(lost, True, 0, keccak(text="recheck")))
        unappealed = key()
        validator.invalidate_hard(nodes[1].address, unappealed, 7, evidence)
        chain.advance_time(settings.reward_lock_period + 1)
        measure("releaseEscrow (window over, to treasury)", lambda: second.release_escrow(unappealed))
        measure("claimRewards (1 key)", lambda: op.claim_rewards(nodes[0].address, [first]))
        claim_keys = keys[:3] + [k for _, k, _ in items]
        measure(f"claimRewards ({len(claim_keys)} keys)", lambda: op.claim_rewards(nodes[0].address, claim_keys),
                items=len(claim_keys))
        measure("leavePool", lambda: op.leave_pool(nodes[2].address))
        chain.advance_time(settings.unbonding_period + 1)
        measure("withdraw", lambda: op.withdraw(nodes[2].address))
        measure("setRewardPerUnit", lambda: admin.set_reward_per_unit(2 * 10**15))
        measure("setSlashPenalty", lambda: admin.set_slash_penalty(5 * TOKEN))
        measure("setMinStake", lambda: admin.set_min_stake(20 * TOKEN))
        measure("setTreasury", lambda: admin.set_treasury(Identity.create().address))
        measure("defundRewards", lambda: admin.defund_rewards(admin_id.address, TOKEN))
        measure("pause", admin.pause)
        measure("unpause", admin.unpause)

    for row in rows:
        row["ratio"] = round(row["gas_per_item"] / anchor.gas_used, 2)
    print(f"{'call':46} {'gas':>9} {'items':>5} {'gas/item':>9} {'x transfer':>10} {'ms':>8}")
    for r in rows:
        print(f"{r['call']:46} {r['gas']:>9} {r['items']:>5} {r['gas_per_item']:>9} {r['ratio']:>10} {r['ms']:>8}")
    result = {
        "bench": "gas", "anchor": "ERC20.transfer to a fresh address", "anchor_gas": anchor.gas_used,
        "machine": harness.machine(),
        "chain": "anvil 1.7.1 (cancun)", "batch": batch, "smoke": args.smoke, "rows": rows,
    }
    harness.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
