"""`prime-validator`: parse the config first (no torch, no web server), then build and serve."""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType

from protocol.errors import PrimeError


class _Terminated(Exception):
    """SIGTERM arrived (an operator, systemd, a container runtime): stop like on Ctrl-C."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def main(argv: list[str] | None = None) -> int:
    from validator.config import load_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("prime-validator")
    # uvicorn shuts its server down on SIGTERM and then raises the signal again; with the default
    # handler that killed the process before `service.stop()` (checker, reporter, ledger) could run.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)  # --help exits here, before torch
        import uvicorn

        from validator.app import build_app
        from validator.server import settle_heap, uvicorn_config
        from validator.service import Service

        service = Service(cfg)
        service.start()
        log.info("validator %s for run %s on http://%s:%d (ledger %s)", service.identity.address, cfg.run.run_id,
                 cfg.host, cfg.port, "postgresql" if cfg.ledger_dsn else cfg.state_dir / "ledger.sqlite")
        try:
            server = uvicorn.Server(uvicorn_config(build_app(service), cfg.gate, host=cfg.host, port=cfg.port,
                                                   stats=service.core.stats))
            log.info("start-up's %d objects kept out of garbage collection", settle_heap())
            server.run()
        finally:
            service.stop()
    except PrimeError as exc:
        log.error("%s: %s", type(exc).__name__, exc)
        return 2
    except KeyboardInterrupt:
        return 130
    except _Terminated:
        log.info("stopped (SIGTERM)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
