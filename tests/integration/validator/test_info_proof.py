"""A validator proves its `/v1/info` (issue 35 item 8): with a fresh challenge the answer carries the validator's
signature over the challenge and the body's SHA-256, the body staying the cached snapshot. A URL that copies the
body, or replays a proof made for another challenge, proves nothing: a node's directory and a validator's peer
probe both ignore it. A real validator and anvil on loopback."""

from __future__ import annotations

import json

import httpx
import pytest
from chainfixtures import VALIDATOR2
from fastapi import FastAPI, Request, Response
from netfixtures import serve_asgi

from protocol import info_proof
from protocol.errors import SignatureError
from protocol.identity import checksum
from validator.peers import PeerWatch

pytestmark = pytest.mark.timeout(300)


def _look_alike(real_url: str, mode: str) -> FastAPI:
    """`copy`: the real body, no proof; `replay`: the real body with a proof captured for another challenge."""
    app = FastAPI()
    captured = httpx.get(real_url + "/v1/info", params={"challenge": "0x" + "ab" * 32})

    @app.get("/v1/info")
    def info(request: Request) -> Response:
        if mode == "copy":
            return Response(httpx.get(real_url + "/v1/info").content, media_type="application/json")
        return Response(captured.content, media_type="application/json",
                        headers={info_proof.HEADER: captured.headers[info_proof.HEADER]})

    return app


def test_info_is_proved_by_a_signature_over_a_fresh_challenge(make_validator, published) -> None:
    v = make_validator()
    me = v.service.identity.address
    with httpx.Client(timeout=30) as http:
        plain = http.get(v.url + "/v1/info")
        assert plain.status_code == 200 and info_proof.HEADER not in plain.headers
        proven = info_proof.read_info(http, v.url, domain=v.service.domain, timeout_s=30)
        assert proven.address == me and proven.info["validator"] == me
        challenge = info_proof.new_challenge()
        r = http.get(v.url + "/v1/info", params={"challenge": "0x" + challenge.hex()})
        assert json.loads(r.content)["validator"] == me  # the body is the snapshot, a challenge changes nothing
        assert info_proof.check_info_proof(r.headers[info_proof.HEADER], r.content, challenge=challenge,
                                           domain=v.service.domain) == me
        with pytest.raises(SignatureError):  # another challenge, another body, another domain: refused
            info_proof.check_info_proof(r.headers[info_proof.HEADER], r.content, challenge=bytes(32),
                                        domain=v.service.domain)
        with pytest.raises(SignatureError):
            info_proof.check_info_proof(r.headers[info_proof.HEADER], r.content + b" ", challenge=challenge,
                                        domain=v.service.domain)
        with pytest.raises(Exception, match="domain"):
            info_proof.check_info_proof(r.headers[info_proof.HEADER], r.content, challenge=challenge,
                                        domain=v.service.domain + "-other")
        for bad in ("0x" + "AB" * 32, "0x12", "ab" * 33):
            assert http.get(v.url + "/v1/info", params={"challenge": bad}).status_code in (400, 422)

        # look-alikes: copied body, replayed proof; neither is believed by a reader or by a peer probe
        peer = published.chain.account(VALIDATOR2)
        for mode in ("copy", "replay"):
            with serve_asgi(_look_alike(v.url, mode)) as url:
                with pytest.raises(SignatureError):
                    info_proof.read_info(http, url, domain=v.service.domain, timeout_s=30)
                watch = PeerWatch([url], identity=peer, domain=v.service.domain, failover_after_s=0.01)
                try:
                    watch.probe()
                    assert watch.urls() == {} and watch.peers[0].address is None, mode
                    assert "SignatureError" in watch.peers[0].error, watch.peers[0].error
                finally:
                    watch.close()
        # the real one, probed the same way, is known by its proved address
        watch = PeerWatch([v.url], identity=peer, domain=v.service.domain, failover_after_s=0.01)
        try:
            watch.probe()
            assert watch.peers[0].address == checksum(me)
        finally:
            watch.close()
