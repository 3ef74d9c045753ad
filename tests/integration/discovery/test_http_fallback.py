"""`GET /v1/announcements`, the fallback when libp2p is unreachable: a reader without libp2p learns
the current state from any role's list and verifies every envelope itself."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from discovery_harness import DOMAIN, Net, wait_linked, wait_until

from discovery.admission import Admission, Trust, allow
from discovery.board import AnnouncementBoard, admit_to_board
from discovery.errors import DiscoveryError
from discovery.http import ANNOUNCEMENTS_PATH, afetch_announcements, fetch_announcements
from discovery.messages import Topic, ValidatorAnnounced
from protocol.envelope import seal
from protocol.errors import OversizeError, ProtocolError
from protocol.identity import Identity
from protocol.nonce import random_nonce

pytestmark = pytest.mark.timeout(60)


class Served:
    """A real HTTP server on 127.0.0.1 answering `/v1/announcements` with whatever `body` holds."""

    def __init__(self) -> None:
        self.body = b"[]"
        self.status = 200
        served = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (stdlib name)
                status = served.status if self.path == ANNOUNCEMENTS_PATH else 404
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(served.body)))
                self.end_headers()
                self.wfile.write(served.body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def reader(net: Net) -> tuple[Admission, AnnouncementBoard]:
    return Admission(domain=DOMAIN, trust=net.trust), AnnouncementBoard()


def test_a_reader_learns_the_state_a_role_serves(net: Net, served: Served) -> None:
    trainer = net.start(net.trainer)
    validator = net.start(net.validators[0], bootstrap=trainer.addrs)
    wait_linked(trainer, validator)
    trainer.announce_policy(3, b"\x03" * 32, ["http://127.0.0.1:9000"])
    validator.announce_validator("http://127.0.0.1:8701")
    wait_until(lambda: len(validator.board) == 2, "both announcements on the validator's board")
    served.body = validator.board.to_json()  # what the validator serves at /v1/announcements

    admission, board = reader(net)
    result = fetch_announcements(served.url, admission, board)
    assert dict(result.outcomes) == {"new": 2} and not result.refused
    current = board.current_policy()
    assert current is not None and current.body.policy_version == 3 and current.source == "http"  # type: ignore[union-attr]
    assert [v.body.http_url for v in board.validators()] == ["http://127.0.0.1:8701"]  # type: ignore[union-attr]
    # Reading again changes nothing.
    assert dict(fetch_announcements(served.url, admission, board).outcomes) == {"duplicate": 2}


def test_a_lying_server_can_hide_but_not_forge(net: Net, served: Served) -> None:
    trainer = net.start(net.trainer)
    genuine = trainer.announce_policy(3, b"\x03" * 32).wire
    forged = json.loads(genuine)
    forged["body"]["policy_version"] = 4
    impostor = net.start(Identity.create()).announce_relay("http://127.0.0.1:9100", [1]).wire
    off_run = json.loads(impostor)
    off_run["domain"] = DOMAIN.replace("run-a", "run-b")
    served.body = json.dumps([json.loads(genuine), forged, off_run, {"kind": "submission"}]).encode()

    admission, board = reader(net)
    result = fetch_announcements(served.url, admission, board)
    assert dict(result.outcomes) == {"new": 1}
    assert dict(result.refused) == {"bad_signature": 1, "wrong_domain": 1, "unknown_version": 1}
    current = board.current_policy()
    assert current is not None and current.body.policy_version == 3  # type: ignore[union-attr]


def test_bad_answers_are_typed_errors(net: Net, served: Served) -> None:
    admission, board = reader(net)
    served.body = b'{"not": "a list"}'
    with pytest.raises(ProtocolError):
        fetch_announcements(served.url, admission, board)
    served.body = b"[" + b" " * 5000 + b"]"
    with pytest.raises(OversizeError):
        fetch_announcements(served.url, admission, board, max_bytes=4096)
    served.status = 500
    with pytest.raises(DiscoveryError):
        fetch_announcements(served.url, admission, board)
    with pytest.raises(DiscoveryError):
        fetch_announcements(served.url + "/elsewhere", admission, board)
    served.close()
    with pytest.raises(DiscoveryError):
        fetch_announcements(served.url, admission, board, timeout=5)


def test_asyncio_reader(net: Net, served: Served) -> None:
    validators = [Identity.create() for _ in range(2)]
    admission = Admission(domain=DOMAIN, trust=Trust(is_validator=allow(v.address for v in validators)))
    source = AnnouncementBoard()
    peer = "12D3KooWJeBihrd6fXLo9Z5ShnedY1ahcqVjAikAJZ1qQGpD4ohP"
    for i, v in enumerate(validators):
        wire = seal(
            v,
            ValidatorAnnounced(peer_id=peer, http_url=f"http://127.0.0.1:870{i}"),
            domain=DOMAIN,
            nonce=random_nonce(),
        ).to_bytes()
        admit_to_board(
            Admission(domain=DOMAIN, trust=admission.trust),
            source,
            wire,
            topic=Topic.VALIDATORS,
            source="gossip",
        )
    served.body = source.to_json()
    board = AnnouncementBoard()
    result = asyncio.run(asyncio.wait_for(afetch_announcements(served.url, admission, board), timeout=30))
    assert result.admitted == 2 and len(board.validators()) == 2
