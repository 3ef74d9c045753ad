"""prime-validator with discovery on: it announces itself (believed because it holds VALIDATOR_ROLE
on the chain), believes the trainer only for versions on chain, and serves what it believes at
`GET /v1/announcements`; with discovery off the route says so and nothing of libp2p runs."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from discovery_harness import LOOPBACK, policy_version, wait_until

from bench.loopback import MANIFEST_V0
from discovery.admission import Admission, Trust
from discovery.board import AnnouncementBoard
from discovery.config import DiscoveryConfig
from discovery.http import fetch_announcements
from discovery.service import Discovery

pytestmark = pytest.mark.timeout(120)

PUBLIC_URL = "http://validator.test:8700"


def test_validator_announces_itself_and_serves_announcements(
    make_validator: Any, published: Any, tmp_path: Any
) -> None:
    served = make_validator(public_url=PUBLIC_URL, discovery={"enabled": True, "reannounce_s": 1.0})
    info = httpx.get(f"{served.url}/v1/info", timeout=10).json()["discovery"]
    assert info["url"] == PUBLIC_URL and info["addrs"]
    domain = served.service.domain
    trainer_key = published.trainer.identity
    validator_address = served.service.identity.address

    # The trainer joins through the validator's libp2p address (from /v1/info) and announces.
    trainer = Discovery(
        DiscoveryConfig(
            enabled=True, listen=[LOOPBACK], bootstrap=info["addrs"], reannounce_s=1.0, target_peers=0
        ),
        identity=trainer_key,
        domain=domain,
        trust=Trust(trainer=trainer_key.address, is_validator={validator_address}.__contains__),
        state_dir=tmp_path / "trainer",
    )
    trainer.start()
    try:
        wait_until(
            lambda: len(trainer.board.validators()) == 1, "the validator's announcement at the trainer"
        )
        assert trainer.board.validators()[0].body.http_url == PUBLIC_URL  # type: ignore[union-attr]
        trainer.announce_policy(1, MANIFEST_V0, ["http://127.0.0.1:9000"])
        trainer.announce_policy(2, b"\x99" * 32)  # not on chain: the validator must not believe it

        admission = Admission(
            domain=domain,
            trust=Trust(trainer=trainer_key.address, is_validator={validator_address}.__contains__),
        )
        board = AnnouncementBoard()

        def fetched() -> bool:
            fetch_announcements(served.url, admission, board)
            return policy_version_of(board) == 1 and len(board.validators()) == 1

        wait_until(fetched, "policy 1 and the validator in /v1/announcements")
        # Version 2 reached the validator and was dropped there (not on chain), visibly in its metrics.
        wait_until(
            lambda: (
                'prime_validator_discovery{event="dropped.not_believed"}'
                in httpx.get(f"{served.url}/metrics", timeout=10).text
            ),
            "the refusal of v2 in the metrics",
        )
        assert policy_version_of(board) == 1
        assert policy_version(trainer) == 2  # the trainer's own board has no chain hook
    finally:
        trainer.stop()


def policy_version_of(board: AnnouncementBoard) -> int | None:
    current = board.current_policy()
    return None if current is None else current.body.policy_version  # type: ignore[union-attr]


def test_discovery_off_by_default(make_validator: Any) -> None:
    served = make_validator()
    assert httpx.get(f"{served.url}/v1/info", timeout=10).json()["discovery"] is None
    r = httpx.get(f"{served.url}/v1/announcements", timeout=10)
    assert r.status_code == 404 and "off" in r.json()["detail"]
