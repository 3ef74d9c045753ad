"""`prime-trainer`: parse the config first (no torch import), then build and run the trainer."""

from __future__ import annotations

import logging
import sys

from protocol.errors import PrimeError


def main(argv: list[str] | None = None) -> int:
    from trainer.config import load_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)  # --help exits here, before torch
        from trainer.runner import run  # torch and transformers load only now

        run(cfg)
    except PrimeError as exc:
        logging.getLogger("prime-trainer").error("%s: %s", type(exc).__name__, exc)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
