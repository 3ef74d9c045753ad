"""`prime-trainer`: parse the config first (no torch import), then build and run the trainer.

    prime-trainer [--config rl.toml ...]          GRPO (the default)
    prime-trainer sft --config sft.toml ...       supervised warm-up (trainer/sft.py)
    prime-trainer eval --model.type hf ...        score a checkpoint on held-out tasks (trainer/evaluate.py)
"""

from __future__ import annotations

import logging
import os
import sys

from protocol.errors import PrimeError

COMMANDS = ("sft", "eval")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = args.pop(0) if args and args[0] in COMMANDS else "rl"
    if command == "rl" and args and args[0] in ("-h", "--help"):
        print(f"prime-trainer [{'|'.join(COMMANDS)}] [--help] ...: GRPO by default; "
              "`prime-trainer sft --help`, `prime-trainer eval --help` for the others.\n")
    try:
        # --help exits in the config parse, before torch is imported.
        if command == "sft":
            from trainer.config import load_sft_config

            sft_cfg = load_sft_config(args)
            from trainer.sft import run_sft

            run_sft(sft_cfg)
        elif command == "eval":
            from trainer.config import load_eval_config

            eval_cfg = load_eval_config(args)
            from trainer.evaluate import run_eval

            run_eval(eval_cfg)
        else:
            from trainer.config import load_config

            cfg = load_config(args)
            from trainer.runner import run  # torch and transformers load only now

            run(cfg)
    except PrimeError as exc:
        logging.getLogger("prime-trainer").error("%s: %s", type(exc).__name__, exc)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def exit_process(code: int) -> None:
    """Leave with `code`. Under torchrun (WORLD_SIZE > 1) the interpreter's own finalization is skipped, once our
    outputs are flushed: gloo's worker threads may still be freeing the last collective's work, whose tensors need
    the GIL, while the interpreter tears down; the thread then dies in `take_gil` and the C++ runtime aborts
    ("terminate called without an active exception", SIGABRT after a run that finished; torchrun then reports it
    failed: 1 run in 10-40 on a busy 2-core box, CI of 173fc11). Every file, checkpoint and publication is closed
    by then (`trainer.runner.close_run`, the SFT and eval runners)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cli() -> None:
    """The `prime-trainer` console script (and `python -m trainer.cli`, `torchrun -m trainer.cli`)."""
    exit_process(main())


if __name__ == "__main__":
    cli()
