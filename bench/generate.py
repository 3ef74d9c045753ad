"""Generation throughput: the models/ engine against Hugging Face `generate` and vLLM, same model and prompts.

`--engines` picks the generators (default `models,hf`; add `vllm` where vLLM is installed, e.g. in
.venv-vllm after `make setup-vllm`): vLLM runs as the node runs it (`node/vllm_engine.py`: the
protocol's sampler forced inside vLLM, TOPLOC proofs built in its worker, `--threads` OpenMP threads),
one engine per dtype and model, started before the rows are timed, and beside it plain vLLM on the same
settings, checkpoint, threads and prompts with vLLM's own sampler at the same temperature, each completion run
to the length the node's engine gave it (the same work; the anchor of what the protocol costs inside vLLM).
The JSON keeps `ratio_vs_hf` (the models/ engine over HF) and adds `ratio_vs_vllm` (the models/ engine over
the node's vLLM engine) and `ratio_vllm_protocol_over_plain` (the node's vLLM engine over plain vLLM; goal
>= 0.9), keyed `dtype/model/batch`, with the worker's protocol time per token (`vllm_protocol_seconds_per_token`:
choosing and forcing tokens, building proofs) and its share of the engine's wall time (`vllm_protocol_share`, a
direct reading, steadier on a shared box than the ratio of two engines' runs, and stricter: the ratio nets the
protocol against plain vLLM's own sampling, which the node's engine skips) on every row; `info.sampler_search`
says which search the sampler ran (`models/gumbel_cpu.py` compiled, or torch).

For each model (tiny, SmolLM2-135M-Instruct) and batch size (1, 16, 64) both generators get the
same prompts, the same thread count and temperature-1 sampling with no top-k/top-p (HF with its own
sampler, the engine with the seeded Gumbel-max sampler), so sequences stop at different lengths.
Tokens/s counts generated tokens up to and including each sequence's EOS. The same run measures
this machine's dense matmul GFLOP/s for every kernel path the engine can pick in each dtype
(`models/kernels.py`: torch.mm / F.linear in the model dtype, and for bf16 weights the fp32-upcast
paths), and the engine's achieved FLOP/s (2 * params * tokens + attention) as a fraction of the
fastest of them.

Both dtypes run by default, each generator on the same weights in the same dtype: float32, and
bfloat16 (the dtype TOPLOC proofs are built in, so the dtype a node runs). Machines differ: with
AMX/AVX512-BF16 bf16 matmuls are 2-4x faster than fp32 at decode batch sizes; on AVX2-only CPUs
(AMD EPYC here) a plain bf16 torch.mm runs at ~1 GFLOP/s and F.linear (what HF runs) at ~7, while
fp32 reaches ~60. The engine measures its kernels once per machine (in a fresh cache directory per
bench run unless --kernel-cache is given) and prints the chosen paths on every row; --kernel
forces one.

    python -m bench.generate --threads 2 --json out.json           # full run (many minutes on AVX2)
    python -m bench.generate --quick                                # a few minutes (1-3 runs a row)
    python -m bench.generate --smoke --json out.json                # tiny, batch 2, 4 tokens, 1 run (seconds)
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from bench import harness

MIN_PROMPTS = 4  # batch 1 runs this many prompts one at a time
CLOCK = time.perf_counter
"""What a generation's time is measured with (--clock)."""

QUESTIONS = [
    "What is 2 + 2? Answer with a number only.",
    "Write a short poem about the sea.",
    "Name the capital of France in one word.",
    "Explain what a hash function is.",
    "List three colours.",
    "Tell me a story about a robot who learns to paint.",
    "Is the sun a star? Answer yes or no.",
    "Describe how to make a cup of tea, step by step.",
    "What is the opposite of hot?",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "Give me some advice for learning to program.",
]


def prompts_for(loaded: Any, n: int, tiny: bool) -> list[list[int]]:
    import torch

    if tiny:
        gen = torch.Generator().manual_seed(0)
        out = []
        for i in range(n):
            length = 8 + (i * 7) % 40
            out.append([1] + torch.randint(3, 259, (length,), generator=gen).tolist())
        return out
    tok = loaded.tokenizer
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        enc = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        out.append(list(ids))
    return out


def count_until_eos(row: list[int], eos: set[int]) -> int:
    for i, t in enumerate(row):
        if t in eos:
            return i + 1
    return len(row)


def run_hf(loaded: Any, prompts: list[list[int]], max_new: int, seed: int) -> tuple[float, int]:
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    cfg = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new,
        eos_token_id=list(loaded.eos_token_ids),
        pad_token_id=pad,
    )
    torch.manual_seed(seed)
    t0 = CLOCK()
    with torch.inference_mode():
        out = loaded.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    dt = CLOCK() - t0
    eos = set(loaded.eos_token_ids)
    n = sum(count_until_eos(row, eos) for row in out[:, width:].tolist())
    return dt, n


def run_engine(engine: Any, prompts: list[list[int]], max_new: int, seed: int) -> tuple[float, int, int]:
    from models.sampling import SamplingParams

    seeds = [seed * 1000 + i for i in range(len(prompts))]
    t0 = CLOCK()
    gens = engine.generate(prompts, SamplingParams(temperature=1.0), seeds, max_new)
    dt = CLOCK() - t0
    ctx = sum(len(g.prompt_tokens) * len(g.tokens) + len(g.tokens) ** 2 // 2 for g in gens)
    return dt, sum(len(g.tokens) for g in gens), ctx


def run_vllm(engine: Any, prompts: list[list[int]], max_new: int, seed: int) -> tuple[float, int, list[int]]:
    """(seconds, tokens, each completion's length) of the node's vLLM engine on these prompts."""
    from node.engines import Request
    from protocol.run import RunSpec

    run = RunSpec(run_id="bench", max_new_tokens=max_new, temperature=1.0)
    requests = [Request(p, seed * 1000 + i) for i, p in enumerate(prompts)]
    t0 = CLOCK()
    completions = engine.generate(requests, run)
    dt = CLOCK() - t0
    lengths = [len(c.tokens) for c in completions]
    return dt, sum(lengths), lengths


class PlainVllm:
    """Plain vLLM on the same settings, checkpoint and threads as the node's vLLM engine, sampling with vLLM's own
    sampler at the same temperature (no protocol: no seeded sampler forced, no hidden states kept, no proofs).

    Given ``lengths`` (the node's engine's completion lengths on the same prompts) each completion runs to exactly
    that length, EOS or not: the same work. Two samplers' draws end sequences at different steps, and at a small
    batch the steps where few sequences are left decide the tokens/s (seen here: 0.81-0.88x at batch 16 while the
    protocol's own timers said 5-6 % of the wall)."""

    def __init__(self, settings: Any, spec: Any) -> None:
        from node.vllm_engine import checkpoint_of, start_llm

        self.checkpoint = checkpoint_of(spec)
        max_len = settings.max_model_len or min(self.checkpoint.max_context or 4096, 4096)
        self.llm = start_llm(settings, self.checkpoint.path, max_len, protocol=False)

    def generate(self, prompts: list[list[int]], max_new: int, lengths: list[int] | None = None) -> tuple[float, int]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if lengths is None:
            params: Any = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=max_new,
                                         stop_token_ids=list(self.checkpoint.eos), detokenize=False,
                                         skip_special_tokens=False)
        else:
            params = [SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=n, ignore_eos=True,
                                     detokenize=False, skip_special_tokens=False) for n in lengths]
        t0 = CLOCK()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        dt = CLOCK() - t0
        return dt, sum(len(o.outputs[0].token_ids) for o in outs)

    def close(self) -> None:
        import shutil

        from node.vllm_engine import shutdown_llm

        shutdown_llm(self.llm)
        if self.checkpoint.tmp is not None:
            shutil.rmtree(self.checkpoint.tmp, ignore_errors=True)


def matmul_rates(dtype: str, seconds: float) -> dict[str, Any]:
    """Dense square matmul GFLOP/s of every kernel path the engine can pick for weights in ``dtype``.

    The size grows from 256 to 2048 while one call stays short, so a dtype whose plain kernel is
    slow on this CPU (bf16 torch.mm without AVX512-BF16/AMX: ~0.2 GFLOP/s) is measured in seconds.
    """
    import torch

    from models.kernels import Linear, candidates

    torch_dtype = getattr(torch, dtype)
    out: dict[str, Any] = {}
    for path in candidates(torch_dtype):
        n = 256
        while True:
            w = torch.randn(n, n).to(torch_dtype)
            x = torch.randn(n, n).to(torch_dtype)
            lin = Linear(w, None, path)
            t0 = time.perf_counter()
            lin(x)
            dt = time.perf_counter() - t0
            if dt > seconds / 8 or n >= 2048:
                break
            n *= 2
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            lin(x)
            calls += 1
        out[path] = {"gflops": 2 * n**3 * calls / (time.perf_counter() - t0) / 1e9, "size": n}
    return out


def engine_flops(loaded: Any, prompts: list[list[int]], generated: int, ctx_sum: int) -> float:
    cfg = loaded.model.config
    embed = loaded.model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in loaded.model.parameters())
    tied = (
        loaded.model.get_output_embeddings().weight.data_ptr()
        == loaded.model.get_input_embeddings().weight.data_ptr()
    )
    head = loaded.model.get_output_embeddings().weight.numel()
    body = params - embed - (0 if tied else head)  # matmul weights of the layers
    prompt_tokens = sum(len(p) for p in prompts)
    attn_per_ctx = 4 * cfg.num_hidden_layers * cfg.hidden_size  # QK^T and AV, 2 FLOPs each
    prefill_attn = sum(attn_per_ctx * len(p) * len(p) // 2 for p in prompts)
    return (
        2 * body * (prompt_tokens + generated)
        + 2 * head * (len(prompts) + generated)
        + prefill_attn
        + attn_per_ctx * ctx_sum
    )


def main() -> int:
    ap = harness.parser(__doc__, smoke="the tiny model, batch 2, 4 new tokens, one run per row, both dtypes, 1 thread "
                        "(seconds; checks the bench, measures nothing)", quick="short run (a few minutes)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads for both generators")
    ap.add_argument("--models", default="tiny,smollm2", help="comma list of: tiny, smollm2")
    ap.add_argument("--engines", default="models,hf",
                    help="comma list of: models (the models/ engine), hf (Hugging Face generate), vllm (needs vLLM; "
                    "the tiny model runs in vLLM only with head_dim >= 32, so vllm rows use TinyModelSpec(hidden_size=128))")
    ap.add_argument("--batches", default="1,16,64", help="comma list of batch sizes")
    ap.add_argument("--max-new", type=int, default=None, help="max new tokens (default 128, quick 16)")
    ap.add_argument(
        "--dtypes", default="float32,bfloat16", help="comma list of: float32, bfloat16 (both generators use it)"
    )
    ap.add_argument(
        "--repeats", type=int, default=None, help="runs per generator, best kept (default 2, quick 1)"
    )
    ap.add_argument(
        "--extra-repeats-within",
        type=float,
        default=None,
        help="seconds: while a row has taken less than this, run both generators again (up to 3 runs "
        "each); cheap rows get a best-of-3 on a shared box, expensive ones stay at --repeats "
        "(default 0, quick 20)",
    )
    ap.add_argument(
        "--kernel",
        default="auto",
        help="engine matmul kernel: auto (measured per machine, see models/kernels.py) or a path to force "
        "(mm_t, linear, fp32_mm_t, fp32_linear)",
    )
    ap.add_argument(
        "--kernel-cache",
        type=Path,
        default=None,
        help="directory of the engine's kernel choice cache (default: a fresh temporary one, so the "
        "choice is measured in this run)",
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time generations by the wall clock (default) or by this process's CPU time (all its "
        "threads; with --threads 1 on a box shared with other busy processes, their load then does "
        "not show up as slowness of whichever generator it happened to hit)",
    )
    args = ap.parse_args()
    if args.smoke:
        args.models, args.batches, args.threads, args.repeats, args.extra_repeats_within = "tiny", "2", 1, 1, 0.0
        args.max_new = args.max_new or 4
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter

    import tempfile

    import torch

    torch.set_num_threads(args.threads)
    from models import load
    from models.engine import Engine
    from models.sampling import search_path
    from protocol.model_spec import SmolLM2Spec, TinyModelSpec

    max_new = args.max_new or (16 if args.quick else 128)
    args.repeats = args.repeats or (1 if args.quick else 2)
    if args.extra_repeats_within is None:
        args.extra_repeats_within = 20.0 if args.quick else 0.0
    batches = [int(b) for b in args.batches.split(",")]
    engines = args.engines.split(",")
    for e in engines:
        if e not in ("models", "hf", "vllm"):
            ap.error(f"unknown engine {e!r}")
    dtypes = args.dtypes.split(",")
    for dt_name in dtypes:
        if dt_name not in ("float32", "bfloat16"):
            ap.error(f"unknown dtype {dt_name!r}")
    kernel_cache = args.kernel_cache or Path(tempfile.mkdtemp(prefix="prime-kernels-"))
    machine = harness.machine(args.threads)
    rates = {d: matmul_rates(d, 0.05 if args.smoke else 0.5 if args.quick else 2.0) for d in dtypes}
    peaks = {d: max(r["gflops"] for r in rates[d].values()) * 1e9 for d in dtypes}
    info = {
        "machine": machine,
        "dtypes": dtypes,
        "max_new_tokens": max_new,
        "engines": engines,
        "repeats": args.repeats,
        "extra_repeats_within_s": args.extra_repeats_within,
        "kernel": args.kernel,
        "clock": args.clock,
        "smoke": args.smoke,
        "matmul_gflops": rates,
        "load_average": os.getloadavg(),
        "sampler_search": search_path(),  # models/sampling.py: compiled (numba) or torch, the same tokens
    }
    print(f"cpu: {harness.describe(machine)}")
    print(f"sampler search on CPU logits: {info['sampler_search']}")
    print(f"clock={args.clock} threads={args.threads} max_new_tokens={max_new} cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f}")
    for d in dtypes:
        print(
            f"dense {d} matmul GFLOP/s by kernel path: "
            + ", ".join(f"{p} {r['gflops']:.1f} (n={r['size']})" for p, r in rates[d].items())
        )
    results: list[dict[str, Any]] = []
    kernels: dict[str, Any] = {}
    header = (
        f"{'dtype':8} {'model':8} {'batch':>5} {'hf tok/s':>9} {'plain vllm':>10} {'vllm tok/s':>10} "
        f"{'prot/plain':>10} {'prot share':>10} {'engine tok/s':>12} {'vs hf':>6} {'vs vllm':>7} {'eng GFLOP/s':>11} {'of peak':>7}  kernels"
    )
    print(header)
    for dtype, name in [(d, m) for d in dtypes for m in args.models.split(",")]:
        peak = peaks[dtype]
        # vLLM's CPU attention needs head_dim >= 32: with vllm in the mix every engine runs that tiny shape
        spec = (TinyModelSpec(hidden_size=128) if "vllm" in engines else TinyModelSpec()) if name == "tiny" \
            else SmolLM2Spec()
        loaded = load(spec, dtype=dtype)
        vllm = plain = None
        if "vllm" in engines:
            from node.config import VllmEngineSettings
            from node.vllm_engine import VllmEngine

            settings = VllmEngineSettings(dtype=dtype, threads=args.threads, max_num_seqs=max(batches))
            t0 = time.perf_counter()
            vllm = VllmEngine(settings, spec)
            info.setdefault("vllm_start_seconds", {})[f"{dtype}/{name}"] = time.perf_counter() - t0
            info["vllm_worker_sampler_search"] = vllm.runtime.cpu_search
            plain = PlainVllm(settings, spec)
        t0 = time.perf_counter()
        engine = Engine(loaded, kernel=args.kernel, kernel_cache=kernel_cache)
        build_s = time.perf_counter() - t0
        choice = engine.kernels
        paths = choice.summary() if choice is not None else "generic"
        if choice is not None:
            kernels[f"{dtype}/{name}"] = {**choice.to_json(), "engine_build_seconds": build_s}
        warm = prompts_for(loaded, 2, name == "tiny")
        run_engine(engine, warm, 4, 0)
        if "hf" in engines:
            run_hf(loaded, warm, 4, 0)
        if vllm is not None and plain is not None:
            run_vllm(vllm, warm, 4, 0)
            plain.generate(warm, 4)
        for b in batches:
            # Small batches run several groups one after another over the same prompt mix, so
            # batch 1 is not a single (possibly one-word) answer.
            pool = prompts_for(loaded, max(b, MIN_PROMPTS), name == "tiny")
            groups = [pool[i : i + b] for i in range(0, len(pool), b)]
            prompts = pool
            # Alternate the two and keep each one's fastest run: on a shared machine the best run
            # is the one least disturbed by other processes.
            hf_runs, en_runs, vl_runs, pl_runs = [], [], [], []
            protocol_before = vllm.runtime.protocol_seconds() if vllm is not None else {}
            row_t0, r = time.perf_counter(), 0
            while r < args.repeats or (r < 3 and time.perf_counter() - row_t0 < args.extra_repeats_within):
                if "hf" in engines:
                    hf = [run_hf(loaded, g, max_new, seed=b * 100 + r) for g in groups]
                    hf_runs.append((sum(x[0] for x in hf), sum(x[1] for x in hf)))
                if vllm is not None and plain is not None:
                    vl = [run_vllm(vllm, g, max_new, seed=b * 100 + r) for g in groups]
                    vl_runs.append((sum(x[0] for x in vl), sum(x[1] for x in vl)))
                    pl = [plain.generate(g, max_new, x[2]) for g, x in zip(groups, vl, strict=True)]
                    pl_runs.append((sum(x[0] for x in pl), sum(x[1] for x in pl)))
                en = [run_engine(engine, g, max_new, seed=b * 100 + r) for g in groups]
                en_runs.append((sum(x[0] for x in en), sum(x[1] for x in en), sum(x[2] for x in en)))
                r += 1
            hf_dt, hf_n = max(hf_runs, key=lambda x: x[1] / x[0]) if hf_runs else (float("nan"), 0)
            vl_dt, vl_n = max(vl_runs, key=lambda x: x[1] / x[0]) if vl_runs else (float("nan"), 0)
            pl_dt, pl_n = max(pl_runs, key=lambda x: x[1] / x[0]) if pl_runs else (float("nan"), 0)
            en_dt, en_n, ctx = max(en_runs, key=lambda x: x[1] / x[0])
            protocol: dict[str, float] = {}
            if vllm is not None:  # the worker's protocol time per generated token, over all of the row's runs
                after, tokens = vllm.runtime.protocol_seconds(), sum(n for _, n in vl_runs)
                protocol = {k: (after[k] - protocol_before[k]) / max(1, tokens) for k in after}
            flops = engine_flops(loaded, prompts, en_n, ctx) / en_dt
            row = {
                "dtype": dtype,
                "model": name,
                "batch": b,
                "kernel_source": choice.source if choice is not None else "generic",
                "kernel_paths": paths,
                "hf_runs_tok_s": [n / dt for dt, n in hf_runs],
                "engine_runs_tok_s": [n / dt for dt, n, _ in en_runs],
                "hf_tokens": hf_n,
                "hf_seconds": hf_dt,
                "hf_tok_s": hf_n / hf_dt,
                "engine_tokens": en_n,
                "engine_seconds": en_dt,
                "engine_tok_s": en_n / en_dt,
                "ratio_vs_hf": (en_n / en_dt) / (hf_n / hf_dt) if hf_runs else None,
                "vllm_runs_tok_s": [n / dt for dt, n in vl_runs],
                "vllm_tokens": vl_n,
                "vllm_seconds": vl_dt,
                "vllm_tok_s": vl_n / vl_dt if vl_runs else None,
                "ratio_vs_vllm": (en_n / en_dt) / (vl_n / vl_dt) if vl_runs else None,
                "vllm_plain_runs_tok_s": [n / dt for dt, n in pl_runs],
                "vllm_plain_tok_s": pl_n / pl_dt if pl_runs else None,
                "ratio_vllm_protocol_over_plain": (vl_n / vl_dt) / (pl_n / pl_dt) if pl_runs else None,
                "vllm_protocol_seconds_per_token": protocol or None,
                # the share of the node's vLLM engine's wall time its worker spent on the protocol (a direct reading,
                # steadier than the tok/s ratio of two engines on a shared box)
                "vllm_protocol_share": sum(protocol.values()) * vl_n / vl_dt if protocol and vl_runs else None,
                "engine_flops": flops,
                "fraction_of_matmul_peak": flops / peak,
            }
            results.append(row)
            def cell(v: float | None, width: int, fmt: str) -> str:
                return f"{'-':>{width}}" if v is None else f"{v:>{width}{fmt}}"

            print(
                f"{dtype:8} {name:8} {b:>5} {cell(row['hf_tok_s'] if hf_runs else None, 9, '.1f')} "
                f"{cell(row['vllm_plain_tok_s'], 10, '.1f')} {cell(row['vllm_tok_s'], 10, '.1f')} "
                f"{cell(row['ratio_vllm_protocol_over_plain'], 9, '.2f')}x {cell(row['vllm_protocol_share'], 10, '.1%')} "
                f"{row['engine_tok_s']:>12.1f} "
                f"{cell(row['ratio_vs_hf'], 5, '.2f')}x {cell(row['ratio_vs_vllm'], 6, '.2f')}x "
                f"{flops / 1e9:>11.2f} {flops / peak:>6.1%}  {paths}",
                flush=True,
            )
        if vllm is not None and plain is not None:
            vllm.close()
            plain.close()
        del engine, loaded
    ratio_vs_hf = {f"{r['dtype']}/{r['model']}/{r['batch']}": r["ratio_vs_hf"] for r in results
                   if r["ratio_vs_hf"] is not None}
    ratio_vs_vllm = {f"{r['dtype']}/{r['model']}/{r['batch']}": r["ratio_vs_vllm"] for r in results
                     if r["ratio_vs_vllm"] is not None}
    protocol_over_plain = {f"{r['dtype']}/{r['model']}/{r['batch']}": r["ratio_vllm_protocol_over_plain"]
                           for r in results if r["ratio_vllm_protocol_over_plain"] is not None}
    below = {k: v for k, v in ratio_vs_hf.items() if v < 1.0}
    if ratio_vs_hf:
        print("all rows at least 1x HF generate" if not below else f"rows below 1x HF: {below}")
    if ratio_vs_vllm:
        faster = sorted(k for k, v in ratio_vs_vllm.items() if v >= 1.0)
        print(f"models/ engine at least as fast as vLLM on {len(faster)} of {len(ratio_vs_vllm)} rows: "
              f"{', '.join(faster) or 'none'}")
    protocol_share = {f"{r['dtype']}/{r['model']}/{r['batch']}": r["vllm_protocol_share"]
                      for r in results if r["vllm_protocol_share"] is not None}
    if protocol_share:  # the direct reading: the worker's own protocol time over the engine's wall time
        over = {k: round(v, 3) for k, v in protocol_share.items() if v > 0.1}
        print("the protocol takes at most 10% of the vLLM worker's time on every row" if not over
              else f"rows where the protocol takes more than 10% of the vLLM worker's time: {over}")
    if protocol_over_plain:  # two engines' best runs: on a shared 2-core box one engine's runs spread by +-25 %
        below = {k: round(v, 3) for k, v in protocol_over_plain.items() if v < 0.9}
        print("node's vLLM engine at least 0.9x plain vLLM's tokens/s on every row" if not below
              else f"rows where the node's vLLM engine ran under 0.9x plain vLLM's tokens/s (best run each): {below}")
    out = {"info": info, "kernels": kernels, "results": results, "ratio_vs_hf": ratio_vs_hf}
    if ratio_vs_vllm:
        out["ratio_vs_vllm"] = ratio_vs_vllm
        out["ratio_vllm_protocol_over_plain"] = protocol_over_plain
        out["vllm_protocol_share"] = protocol_share
    harness.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
