"""Trainer throughput: training tokens/s, achieved FLOP/s as a fraction of this machine's dense-matmul
FLOP/s measured in the same run, and packing efficiency (useful tokens / processed tokens).

    python -m bench.trainer --quick --json out.json       # ~1-2 min on 2 CPU cores
    python -m bench.trainer --model smollm2 --steps 4 --seq-len 1024
    python -m bench.trainer --smoke --json out.json       # the tiny model, 1 small step (seconds)

Packing efficiency is useful tokens over tokens run through the model (rows are cut to their
micro-batch's longest row, so a half-empty last row costs nothing with micro_batch_rows = 1);
`row_fill` is useful tokens over rows * seq_len (how full the fixed-length rows are).

Achieved FLOP/s counts 6 * (matmul parameters) per trained token (forward + backward, the usual
Kaplan estimate; attention scores are not counted, so the fraction is a lower bound). The anchor is
the best of several fp32 `torch.mm` calls of a square matrix, on the same threads, in the same process.
"""

from __future__ import annotations

import random
import tempfile
import time
from typing import Any

import torch

from bench import harness
from protocol.model_spec import SmolLM2Spec, TinyModelSpec
from protocol.rollout_files import Sample
from trainer.config import TrainerConfig
from trainer.grpo import Trainer
from trainer.source import Batch, RolloutSource, WindowCounts


def matmul_flops(n: int, repeats: int) -> float:
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


class SyntheticSource(RolloutSource):
    """GRPO groups with reverse-text-like shapes (prompt 40-80 tokens, completion 8-`max_completion`)."""

    def __init__(self, vocab: int, group_size: int, max_completion: int, seed: int = 0) -> None:
        self.vocab, self.group_size, self.max_completion = vocab, group_size, max_completion
        self.rng = random.Random(seed)

    def next_batch(self, step: int, n_groups: int, async_level: int, *, min_groups: int | None = None,
                   fill_timeout_s: float | None = None, expected: int | None = None) -> Batch:
        groups = []
        for g in range(n_groups):
            prompt = [self.rng.randrange(3, self.vocab) for _ in range(self.rng.randint(40, 80))]
            group = []
            for k in range(self.group_size):
                n = self.rng.randint(8, self.max_completion)
                group.append(Sample(
                    tokens=tuple(prompt) + tuple(self.rng.randrange(3, self.vocab) for _ in range(n)),
                    loss_mask=(False,) * len(prompt) + (True,) * n,
                    sampling_logprobs=(0.0,) * len(prompt) + tuple(-self.rng.uniform(0.1, 4) for _ in range(n)),
                    reward=float(k % 2), group_id=f"{step}-{g}", policy_version=step, task_id=str(g),
                    env_name="synthetic", env_version="1",
                ))
            groups.append(group)
        return Batch(groups=groups, counts=WindowCounts(accepted=n_groups * self.group_size))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in a matmul per token: every Linear (embedding lookups excluded)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def main() -> None:
    p = harness.parser(__doc__, smoke="the tiny model, one timed step of 2 groups x 2 at seq_len 128 (seconds; "
                       "checks the bench, measures nothing)", quick="a short run (~1-2 min)")
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up step)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--groups", type=int, default=8, help="GRPO groups per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-completion", type=int, default=200)
    p.add_argument("--micro-batch-rows", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--matmul-n", type=int, default=2048)
    args = p.parse_args()
    if args.quick:
        args.steps, args.seq_len, args.groups, args.group_size = 2, 512, 4, 4
        args.max_completion, args.matmul_n = 120, 1024
    if args.smoke:
        args.model, args.steps, args.seq_len, args.groups, args.group_size = "tiny", 1, 128, 2, 2
        args.max_completion, args.matmul_n = 16, 128
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from models import load

    spec = SmolLM2Spec() if args.model == "smollm2" else TinyModelSpec(hidden_size=256, intermediate_size=1024,
                                                                         num_layers=4, num_heads=8, num_kv_heads=4)
    loaded = load(spec)
    model = loaded.model
    vocab = int(model.config.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainerConfig.model_validate({
            # one step more than it runs (a warm-up + the timed ones): the trainer saves a checkpoint at its last
            # step, and the bench times training only (train_time_s excludes the save anyway)
            "max_steps": args.steps + 2, "progress": False, "dtype": "float32",
            "batch": {"groups_per_step": args.groups, "seq_len": args.seq_len,
                      "micro_batch_rows": args.micro_batch_rows, "async_level": 0},
            "checkpoint": {"dir": tmp, "interval": 10**9},
        })
        trainer = Trainer(cfg, model, SyntheticSource(vocab, args.group_size, args.max_completion), torch.device("cpu"))
        anchor_before = matmul_flops(args.matmul_n, 5)
        trainer.train_step()  # warm-up
        tokens = processed = 0
        fills = []
        train_s = 0.0
        for _ in range(args.steps):
            m = trainer.train_step().metrics
            train_s += m["train_time_s"]
            tokens += m["useful_tokens"]
            processed += m["processed_tokens"]
            fills.append(m["row_fill"])
        anchor_after = matmul_flops(args.matmul_n, 5)
    anchor = max(anchor_before, anchor_after)
    n_mm = matmul_params(model)
    tok_s = tokens / train_s
    # Padding costs FLOPs too, but only useful tokens count as achieved work.
    achieved = 6.0 * n_mm * tok_s
    result = {
        "machine": harness.machine(),
        "threads": torch.get_num_threads(),
        "model": args.model,
        "matmul_params": n_mm,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "train_tokens_per_s": tok_s,
        "achieved_flops": achieved,
        "matmul_flops": anchor,
        "matmul_n": args.matmul_n,
        "matmul_fraction": achieved / anchor,
        "packing_efficiency": tokens / processed if processed else 0.0,
        "row_fill": sum(fills) / len(fills),
        "quick": args.quick,
        "smoke": args.smoke,
    }
    print(f"{'metric':<24}{'value':>16}")
    for k in ("train_tokens_per_s", "achieved_flops", "matmul_flops", "matmul_fraction", "packing_efficiency",
              "row_fill"):
        print(f"{k:<24}{result[k]:>16.4g}")
    print(f"({args.model}, {n_mm / 1e6:.1f}M matmul params, seq_len {args.seq_len}, {result['threads']} threads)")
    harness.write_json(args.json, result)


if __name__ == "__main__":
    main()
