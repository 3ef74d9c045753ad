"""Container healthcheck: exit 0 when a role answers, 1 otherwise (stdlib only, 5 s budget).

    python /app/docker/healthcheck.py http://127.0.0.1:8700/ready        # HTTP 2xx
    python /app/docker/healthcheck.py --rpc http://127.0.0.1:8545         # JSON-RPC eth_chainId answers
    python /app/docker/healthcheck.py --file /shared/deployment.json      # a file exists and is JSON
"""

from __future__ import annotations

import json
import sys
import urllib.request

TIMEOUT_S = 5.0


def check(argv: list[str]) -> bool:
    if len(argv) == 2 and argv[0] == "--rpc":
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}).encode()
        req = urllib.request.Request(argv[1], data=body, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:  # noqa: S310 - a URL the compose file gives
            return "result" in json.loads(resp.read(65536))
    if len(argv) == 2 and argv[0] == "--file":
        with open(argv[1], "rb") as fh:
            json.load(fh)
        return True
    if len(argv) == 1 and argv[0].startswith("http://"):
        with urllib.request.urlopen(argv[0], timeout=TIMEOUT_S) as resp:  # noqa: S310
            return 200 <= int(resp.status) < 300
    raise SystemExit(f"usage: {__doc__}")


def main() -> int:
    try:
        return 0 if check(sys.argv[1:]) else 1
    except (OSError, ValueError) as exc:  # refused, timed out, HTTP error status, bad JSON
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
