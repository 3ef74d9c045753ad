"""The GPU path (issue 38): rollouts made on a device, timed against Hugging Face there, checked by a CPU validator.

Three commands, one program:

    python -m bench.gpu --device cuda --inputs .gpu-bundle/inputs.json --json $OUT/gpu.json --out $OUT
        the device run (on a GPU machine: from the bundle, see `bench.gpu_bundle` and `make gpu-bundle`)
    python -m bench.gpu check --rollouts DIR [--json PATH]
        here: a CPU validator's full checks on DIR/rollouts.json, every margin against its threshold
    python -m bench.gpu --smoke --json out.json
        both on the tiny model on this CPU (seconds; the default test tier runs it)

**The device run.** For each model of the inputs and each dtype (bf16, then fp32) it loads the model on
`--device`, generates the rollouts with the `models/` engine and the protocol's seeded sampler, proves them
(`toploc.validation.prove`, as a node does), runs Hugging Face `generate` (sampling, same prompts, batch and
limit) on the same device as the anchor, and times a validator-style check there (`toploc.validation.measure`:
batched prefill, TOPLOC verification, the seeded replay) on the rollouts it made. Rows: engine tokens/s over
HF's (`ratio_engine_over_hf`), check seconds over generation seconds (`check_over_generation`), and the
device's own margins (a GPU validator checking GPU work, under `toploc.ToplocThresholds` defaults). The
rollouts (prompt, tokens, logprobs, finish reason, proofs, seed) go to `--out`/rollouts.json; both files are
rewritten after every row, so a run cut short still brings back what it finished. `--budget-s` skips the rows
that would start after it (a device command has at most 10 minutes).

**The models.** `tiny` is the validator's default model (`TinyModelSpec(hidden_size=128)`). `smollm2-shape` is
a `TinyModelSpec` of SmolLM2-135M's shape (vocabulary 49,152, width 576, MLP 1,536, 30 layers, 9 heads, 3 KV
heads): the real weights (~270 MB in bf16) do not travel in one device command, while a tiny spec's weights
come from an integer hash of the seed (`models.loading.build_tiny_model`), made on the CPU and then moved to
the device, so the GPU and the validator here hold bit-identical weights without carrying a byte of them. What
it shows: the engine, sampler and TOPLOC on a CUDA device at SmolLM2's sizes and kernels (bf16/fp32 matmuls,
SDPA attention, 49k-way sampling), their speed there, and whether a CPU validator accepts the work and by what
margins. What it does not: trained weights (peaked logits and activation outliers change the margins; a random
model almost never draws EOS, so termination is checked on length endings only), SmolLM2's tied LM head and
rope theta 100,000 (the tiny spec unties the head: 163M parameters instead of 135M, and uses theta 10,000),
the tokenizer (prompts are token ids drawn from a hash), vLLM, or a node's network round trip.

**Inputs.** Prompts are token ids from SHA-256 of (model, task, position); sampling seeds are the protocol's
(`protocol.seeds.sampling_seed`) for a fixed assignment. `bench.gpu_bundle` computes them here into
inputs.json, so the device run never imports `protocol.seeds` (whose address checksum needs eth-utils, which a
GPU machine lacks); without `--inputs` the program computes them itself. The check rebuilds both from the
assignment, as a validator does, and counts any that differ.

**The check** loads the same spec on the CPU in the validator's default dtype (`validator.config`:
`float32`; `--validator-dtype` for others), runs `toploc.validation.measure` with the thresholds of the
validator's default `CheckSettings` (`validator.judge.thresholds_of`) and gives the verdict by
`validator.judge.judge`, the validator's own rule (rewards are not part of it: no environment here). It prints
per row the worst chunk (exponent mismatches, mantissa error mean and median), the largest sampling margin and
the mismatches, the largest logprob error, termination failures and skipped EOS ties, each next to its
threshold, and writes every sample's measurement (per chunk) to the JSON. It exits 1 when a verdict is not
`accepted`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import harness

NODE = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"  # anvil's public dev account 1 (an address, no key)
POOL = "0x5FbDB2315678afecb367f032d93F642f64180aa3"  # anvil's first contract address
ASSIGNMENT: dict[str, Any] = {"chain_id": 31337, "pool": POOL, "run_id": "gpu-path", "node": NODE,
                              "policy_version": 0, "counter": 0, "manifest_hash": "ab" * 32}
"""The assignment whose sampling seeds the rollouts use (protocol.seeds); the check recomputes them."""
PARAMS: dict[str, Any] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
"""The run's sampling parameters (the RL default: temperature 1, no truncation)."""
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"type": "tiny", "hidden_size": 128},
    "smollm2-shape": {"type": "tiny", "seed": 135, "vocab_size": 49152, "hidden_size": 576,
                      "intermediate_size": 1536, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3,
                      "max_position_embeddings": 2048},
}
"""Model name -> `protocol.model_spec` spec (see the module docstring for what smollm2-shape is and is not)."""
DTYPES = ("bfloat16", "float32")
FIRST_TOKEN = 3  # ids 0-2 are pad, bos, eos in a tiny spec's config and tokenizer


@dataclass(frozen=True)
class Size:
    tasks: int
    samples: int
    """Samples per task (a GRPO group: one prompt, several seeds)."""
    prompt_min: int
    prompt_max: int
    max_new: int


SIZES: dict[str, dict[str, Size]] = {
    "smoke": {"tiny": Size(2, 2, 8, 16, 40)},
    "quick": {"tiny": Size(4, 4, 16, 48, 64), "smollm2-shape": Size(2, 2, 16, 32, 32)},
    "full": {"tiny": Size(8, 4, 32, 96, 128), "smollm2-shape": Size(16, 4, 32, 96, 128)},
}
"""Rollouts per model at each size: `full` is the device run's (64 SmolLM2-shape sequences of up to 128 tokens)."""


# -- inputs: prompts and seeds, fixed by the protocol ------------------------------------------------


def _hash_int(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big")


def prompt_tokens(model: str, vocab_size: int, task: int, size: Size) -> list[int]:
    """Task `task`'s prompt: token ids in [3, vocab) from SHA-256 (the same on every machine, no tokenizer)."""
    n = size.prompt_min + _hash_int("gpu-path/len", model, task) % (size.prompt_max - size.prompt_min + 1)
    return [FIRST_TOKEN + _hash_int("gpu-path/token", model, task, i) % (vocab_size - FIRST_TOKEN) for i in range(n)]


def task_id(prompt: list[int]) -> str:
    """A task's id (32 hex digits, the wire format's): the digest of its prompt."""
    return hashlib.sha256(json.dumps(prompt).encode()).hexdigest()[:32]


def seeds_of(tid: str, samples: int, assignment: dict[str, Any]) -> list[int]:
    """The protocol's sampling seeds of a task's samples (needs eth-utils: computed here, not on a GPU machine)."""
    from protocol.seeds import sampling_seed

    a = assignment
    return [sampling_seed(a["node"], a["policy_version"], tid, j, run_id=a["run_id"], chain_id=a["chain_id"],
                          pool=a["pool"], counter=a["counter"], manifest_hash=bytes.fromhex(a["manifest_hash"]))
            for j in range(samples)]


def make_inputs(size_name: str, models: list[str] | None = None) -> dict[str, Any]:
    """The device run's inputs: per model its spec, limit, and per task the prompt and the samples' seeds."""
    out = []
    for name, size in SIZES[size_name].items():
        if models is not None and name not in models:
            continue
        spec = MODELS[name]
        vocab = int(spec.get("vocab_size", 512))
        tasks = []
        for t in range(size.tasks):
            prompt = prompt_tokens(name, vocab, t, size)
            tid = task_id(prompt)
            tasks.append({"task_id": tid, "prompt_tokens": prompt, "seeds": seeds_of(tid, size.samples, ASSIGNMENT)})
        out.append({"name": name, "spec": spec, "size": size_name, "max_tokens": size.max_new, "tasks": tasks})
    return {"format": 1, "assignment": ASSIGNMENT, "params": PARAMS, "models": out}


# -- the device run ----------------------------------------------------------------------------------


class Clock:
    """Wall seconds of device work: synchronizes a CUDA device before reading the clock."""

    def __init__(self, device: Any) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda"

    def now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()


def hf_generate(loaded: Any, prompts: list[list[int]], max_new: int, seed: int) -> int:
    """Hugging Face `generate` (sampling at temperature 1, no truncation) of `prompts` on the model's device;
    the tokens generated up to each row's EOS."""
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new,
                           eos_token_id=list(loaded.eos_token_ids), pad_token_id=0)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = loaded.model.generate(input_ids=ids.to(loaded.device), attention_mask=mask.to(loaded.device),
                                    generation_config=cfg)
    eos = set(loaded.eos_token_ids)
    n = 0
    for row in out[:, width:].tolist():
        n += next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
    return n


def margins_of(reports: list[Any], claimed_logprobs: list[list[float]], th: Any) -> dict[str, Any]:
    """The worst of each measurement over `reports` (`toploc.validation.SequenceReport`), next to `th`."""
    chunks = [p for r in reports for p in r.proofs]
    sampling = [r.sampling for r in reports if r.sampling is not None]
    return {
        "errors": [r.error for r in reports if r.error is not None],
        "exp_mismatches_max": max((p.exp_mismatches for p in chunks), default=0),
        "mant_err_mean_max": max((p.mant_err_mean for p in chunks), default=0.0),
        "mant_err_median_max": max((p.mant_err_median for p in chunks), default=0.0),
        "failing_chunks": sum(len(th.failing_chunks(r.proofs)) for r in reports),
        "sampling_max_margin": max((s.max_margin for s in sampling), default=0.0),
        "sampling_mismatches": sum(len(s.mismatch_positions) for s in sampling),
        "logprob_max_error": max((abs(a - b) for r, lps in zip(reports, claimed_logprobs, strict=True)
                                  for a, b in zip(r.logprobs, lps, strict=True)), default=0.0),
        "termination_violations": sum(len(r.termination.violations) for r in reports if r.termination),
    }


def run_row(model: dict[str, Any], dtype: str, device: str, repeats: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One (model, dtype) on `device`: (the timing row, its rollouts)."""
    import torch

    from models import load
    from models.engine import Engine
    from models.sampling import SamplingParams
    from protocol.model_spec import parse_model_spec
    from protocol.timing import StageTimer
    from toploc import ToplocThresholds
    from toploc.validation import Rollout, measure, prove

    spec = parse_model_spec(model["spec"])
    params, th, clock = SamplingParams(**PARAMS), ToplocThresholds(), Clock(device)
    prompts = [t["prompt_tokens"] for t in model["tasks"] for _ in t["seeds"]]
    seeds = [s for t in model["tasks"] for s in t["seeds"]]
    max_new = int(model["max_tokens"])
    t0 = time.perf_counter()
    loaded = load(spec, dtype=dtype, device=device)  # weights made on the CPU from the seed, then moved
    load_s = time.perf_counter() - t0
    engine = Engine(loaded)
    engine.generate(prompts[:2], params, seeds[:2], 4)  # warm-up: kernels, allocator, cuBLAS handles
    hf_generate(loaded, prompts[:2], 4, 0)
    gen_s = hf_s = float("inf")
    for _ in range(repeats):
        t0 = clock.now()
        gens = engine.generate(prompts, params, seeds, max_new)
        gen_s = min(gen_s, clock.now() - t0)
        t0 = clock.now()
        hf_tokens = hf_generate(loaded, prompts, max_new, 0)
        hf_s = min(hf_s, clock.now() - t0)
    t0 = clock.now()
    proofs = [prove(g.hidden_states, th) for g in gens]
    prove_s = clock.now() - t0
    rollouts = [Rollout(g.prompt_tokens, g.tokens, p, g.seed, max_new) for g, p in zip(gens, proofs, strict=True)]
    check_s, timer = float("inf"), StageTimer()
    for _ in range(repeats):
        timer = StageTimer()
        t0 = clock.now()
        reports = measure(loaded, rollouts, params, th, timer=timer)
        check_s = min(check_s, clock.now() - t0)
    tokens = sum(len(g.tokens) for g in gens)
    row = {
        "model": model["name"], "dtype": dtype, "device": device, "sequences": len(gens), "new_tokens": tokens,
        "max_new_tokens": max_new, "finish_eos": sum(g.finish_reason == "eos" for g in gens),
        "load_s": load_s, "engine_s": gen_s, "engine_tok_s": tokens / gen_s, "prove_s": prove_s,
        "hf_s": hf_s, "hf_tokens": hf_tokens, "hf_tok_s": hf_tokens / hf_s,
        "ratio_engine_over_hf": (tokens / gen_s) / (hf_tokens / hf_s),
        "check_s": check_s, "check_tok_s": tokens / check_s, "check_over_generation": check_s / (gen_s + prove_s),
        "check_stages_s": dict(sorted(timer.times.items())),
        "device_margins": margins_of(reports, [g.logprobs for g in gens], th),
        "peak_memory_mib": (torch.cuda.max_memory_allocated() / 2**20) if clock.cuda else None,
    }
    out = {"model": model["name"], "spec": model["spec"], "size": model["size"], "dtype": dtype, "device": device, "max_tokens": max_new,
           "tasks": [{"task_id": t["task_id"], "prompt_tokens": t["prompt_tokens"], "samples": []}
                     for t in model["tasks"]]}
    by_task = iter([(ti, s) for ti, t in enumerate(model["tasks"]) for s in t["seeds"]])
    for g, p in zip(gens, proofs, strict=True):
        ti, seed = next(by_task)
        assert seed == g.seed
        out["tasks"][ti]["samples"].append({"seed": g.seed, "tokens": g.tokens, "logprobs": g.logprobs,
                                            "finish_reason": g.finish_reason, "proofs": [x.hex() for x in p]})
    del engine, loaded, gens
    if clock.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return row, out


def device_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
                            "float32_matmul_precision": torch.get_float32_matmul_precision()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(torch.device(device))
        info.update(name=p.name, memory_gib=p.total_memory / 2**30, capability=f"{p.major}.{p.minor}",
                    bf16_reduced_precision_reduction=torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
    return info


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    inputs = json.loads(args.inputs.read_text()) if args.inputs else make_inputs(size, args.models)
    models = [m for m in inputs["models"] if args.models is None or m["name"] in args.models]
    dtypes = args.dtypes
    size = ",".join(sorted({m["size"] for m in inputs["models"]}))
    result: dict[str, Any] = {"bench": "gpu", "smoke": args.smoke, "size": size,
                              "command": harness.command("gpu"), "machine": harness.machine(),
                              "device": device_info(device), "inputs_sha256": hashlib.sha256(
                                  json.dumps(inputs, sort_keys=True).encode()).hexdigest(),
                              "rows": [], "skipped": []}
    rollouts: dict[str, Any] = {"format": 1, "assignment": inputs["assignment"], "params": inputs["params"],
                                "groups": []}
    print(harness.describe(result["machine"]))
    print(f"device {device}: {json.dumps(result['device'])}", flush=True)
    started = time.perf_counter()
    for model in models:
        for dtype in dtypes:
            if time.perf_counter() - started > args.budget_s:
                result["skipped"].append(f"{model['name']}/{dtype}: past --budget-s {args.budget_s}")
                print(f"skip {model['name']} {dtype}: past the budget", flush=True)
                continue
            print(f"{model['name']} {dtype} on {device} ...", flush=True)
            row, group = run_row(model, dtype, device, args.repeats)
            result["rows"].append(row)
            rollouts["groups"].append(group)
            print(row_line(row), flush=True)
            harness.write_json(args.json, result)
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "rollouts.json").write_text(json.dumps(rollouts) + "\n")
    result["wall_s"] = time.perf_counter() - started
    return result


def row_line(r: dict[str, Any]) -> str:
    m = r["device_margins"]
    return (f"  {r['model']:14} {r['dtype']:9} {r['sequences']:3} seqs {r['new_tokens']:6} tok | engine "
            f"{r['engine_tok_s']:9.1f} tok/s  hf {r['hf_tok_s']:9.1f} tok/s  x{r['ratio_engine_over_hf']:.2f} | "
            f"prove {r['prove_s']:.2f}s  check {r['check_s']:.2f}s ({r['check_over_generation']:.3f} of gen) | "
            f"on device: exp<= {m['exp_mismatches_max']} mean<= {m['mant_err_mean_max']:.2f} "
            f"median<= {m['mant_err_median_max']:.2f} margin<= {m['sampling_max_margin']:.3f} "
            f"mismatches {m['sampling_mismatches']} lp<= {m['logprob_max_error']:.4f}")


# -- the check here: a CPU validator ------------------------------------------------------------------


def check(rollouts_dir: Path, validator_dtypes: list[str] | None, threads: int | None) -> dict[str, Any]:
    """A CPU validator's full checks (`toploc.validation.measure`, `validator.judge.judge` with the default
    `CheckSettings`) on DIR/rollouts.json; see the module docstring."""
    import torch

    from models import load
    from models.sampling import SamplingParams
    from protocol.model_spec import parse_model_spec
    from protocol.rollout import SampleRollout, Submission, TaskRollouts
    from toploc.validation import Rollout, measure
    from validator.config import CheckSettings, ValidatorConfig
    from validator.judge import judge, thresholds_of

    if threads:
        torch.set_num_threads(threads)
    data = json.loads((rollouts_dir / "rollouts.json").read_text())
    checks = CheckSettings()
    th = thresholds_of(checks)
    params = SamplingParams(**data["params"])
    a = data["assignment"]
    default_dtype = ValidatorConfig.model_fields["dtype"].default
    thresholds = {"max_exp_mismatches": th.max_exp_mismatches, "max_mant_err_mean": th.max_mant_err_mean,
                  "max_mant_err_median": th.max_mant_err_median,
                  "sampling_margin_tolerance": th.sampling_margin_tolerance,
                  "max_sampling_mismatches": th.max_sampling_mismatches,
                  "logprob_tolerance": checks.logprob_tolerance, "eos_tie_drift": checks.eos_tie_drift}
    rows: list[dict[str, Any]] = []
    loaded_cache: dict[tuple[str, str], Any] = {}
    for g in data["groups"]:
        spec = parse_model_spec(g["spec"])
        # The validator rebuilds prompts and seeds from the assignment: never taken from the node.
        size = SIZES[g["size"]][g["model"]]
        vocab = int(g["spec"].get("vocab_size", 512))
        rebuilt = [prompt_tokens(g["model"], vocab, t, size) for t in range(len(g["tasks"]))]
        prompt_diffs = sum(r != t["prompt_tokens"] for r, t in zip(rebuilt, g["tasks"], strict=True))
        seeds = [seeds_of(task_id(p), len(t["samples"]), a) for p, t in zip(rebuilt, g["tasks"], strict=True)]
        seed_diffs = sum(s != x["seed"] for ss, t in zip(seeds, g["tasks"], strict=True)
                         for s, x in zip(ss, t["samples"], strict=True))
        sub = Submission(run_id=a["run_id"], node=a["node"], policy_version=a["policy_version"],
                         manifest_hash=b"\0" * 32, counter=a["counter"], env="gpu-path", env_version="1",
                         tasks=tuple(TaskRollouts(task_id=task_id(p), samples=tuple(
                             SampleRollout(tokens=tuple(s["tokens"]), logprobs=tuple(s["logprobs"]),
                                           finish_reason=s["finish_reason"], reward=0.0,
                                           proofs=tuple(bytes.fromhex(x) for x in s["proofs"]))
                             for s in t["samples"])) for p, t in zip(rebuilt, g["tasks"], strict=True)))
        items = [Rollout(p, s["tokens"], [bytes.fromhex(x) for x in s["proofs"]], seed, g["max_tokens"])
                 for p, t, ss in zip(rebuilt, g["tasks"], seeds, strict=True)
                 for s, seed in zip(t["samples"], ss, strict=True)]
        for vd in dict.fromkeys(g["dtype"] if v == "same" else v for v in validator_dtypes or [default_dtype]):
            key = (json.dumps(g["spec"], sort_keys=True), vd)
            if key not in loaded_cache:
                loaded_cache.clear()  # one model at a time in memory
                loaded_cache[key] = load(spec, dtype=vd)
            t0 = time.perf_counter()
            reports = measure(loaded_cache[key], items, params, th, batch_tokens=checks.batch_tokens)
            check_s = time.perf_counter() - t0
            j = judge(sub, reports, th, checks.logprob_tolerance, checks.eos_tie_drift)
            samples = j.samples
            chunks = [c for s in samples for c in s.toploc]
            worst = {
                "exp_mismatches": max((c[0] for c in chunks), default=0),
                "mant_err_mean": max((c[1] for c in chunks), default=0.0),
                "mant_err_median": max((c[2] for c in chunks), default=0.0),
                "sampling_max_margin": max((s.sampling_max_margin for s in samples), default=0.0),
                "sampling_mismatches": max((len(s.sampling_mismatches) for s in samples), default=0),
                "logprob_max_error": max((s.logprob_max_error for s in samples), default=0.0),
                "eos_near_tie_margin": max((m for s in samples for _, m in s.eos_near_ties), default=0.0),
            }
            limits = {"exp_mismatches": th.max_exp_mismatches, "mant_err_mean": th.max_mant_err_mean,
                      "mant_err_median": th.max_mant_err_median,
                      "sampling_max_margin": th.sampling_margin_tolerance,
                      "sampling_mismatches": th.max_sampling_mismatches,
                      "logprob_max_error": checks.logprob_tolerance, "eos_near_tie_margin": checks.eos_tie_drift}
            rows.append({
                "model": g["model"], "generated_on": g["device"], "generated_dtype": g["dtype"],
                "validator_dtype": vd, "samples": len(samples), "tokens": sum(len(i.tokens) for i in items),
                "verdict": "accepted" if j.failure is None else f"{j.failure[0].value}: {j.failure[1]}",
                "worst": worst, "threshold": limits,
                "headroom": {k: limits[k] - worst[k] for k in worst},
                "failing_chunks": sum(len(s.failing_chunks) for s in samples),
                "termination_failures": [list(s.termination) for s in samples if s.termination],
                "eos_skips": sum(len(s.eos_skips) for s in samples),
                "errors": [s.error for s in samples if s.error is not None],
                "prompt_diffs": prompt_diffs, "seed_diffs": seed_diffs, "check_s": check_s,
                "samples_measured": [s.to_json() for s in samples],
            })
            print(check_line(rows[-1]), flush=True)
    return {"bench": "gpu", "check": True, "rollouts": str(rollouts_dir), "thresholds": thresholds,
            "machine": harness.machine(), "rows": rows,
            "accepted": bool(rows) and all(r["verdict"] == "accepted" and not r["prompt_diffs"] and not r["seed_diffs"]
                                           for r in rows)}


def check_line(r: dict[str, Any]) -> str:
    w, t = r["worst"], r["threshold"]
    return (f"  {r['model']:14} made {r['generated_dtype']:9} on {r['generated_on']:6} checked {r['validator_dtype']:9}"
            f" {r['samples']:3} samples: {r['verdict']} | exp {w['exp_mismatches']}/{t['exp_mismatches']} "
            f"mean {w['mant_err_mean']:.2f}/{t['mant_err_mean']} median {w['mant_err_median']:.2f}/"
            f"{t['mant_err_median']} margin {w['sampling_max_margin']:.3f}/{t['sampling_max_margin']} "
            f"mismatches {w['sampling_mismatches']}/{t['sampling_mismatches']} logprob "
            f"{w['logprob_max_error']:.4f}/{t['logprob_max_error']} eos-tie {w['eos_near_tie_margin']:.3f}/"
            f"{t['eos_near_tie_margin']} termination {len(r['termination_failures'])} | prompts differ "
            f"{r['prompt_diffs']} seeds differ {r['seed_diffs']} ({r['check_s']:.1f}s)")


# -- command line -------------------------------------------------------------------------------------


def _csv(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        ap = argparse.ArgumentParser(prog="python -m bench.gpu check", description=check.__doc__)
        ap.add_argument("--rollouts", type=Path, required=True, help="the folder with rollouts.json (the device's $OUT)")
        ap.add_argument("--validator-dtype", type=_csv, default=None,
                        help="comma list of float32, bfloat16, same (the rollouts' dtype); default: the validator's")
        ap.add_argument("--threads", type=int, default=None, help="torch threads of the CPU check")
        ap.add_argument("--json", type=Path, help="write the check's results here as JSON")
        a = ap.parse_args(argv[1:])
        out = check(a.rollouts, a.validator_dtype, a.threads)
        harness.write_json(a.json, out)
        return 0 if out["accepted"] else 1
    ap = harness.parser(__doc__, smoke="the tiny model, 4 rollouts per dtype, then the CPU check (seconds)",
                        quick="the tiny and smollm2-shape models at small sizes (a few minutes on a CPU)")
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when there is one)")
    ap.add_argument("--inputs", type=Path, default=None, help="inputs.json made by bench.gpu_bundle (default: "
                    "computed here from --smoke/--quick/full sizes)")
    ap.add_argument("--models", type=_csv, default=None, help=f"comma list of {', '.join(MODELS)} (default: all)")
    ap.add_argument("--dtypes", type=_csv, default=list(DTYPES), help="comma list of bfloat16, float32")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each side (the fastest counts)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU runs)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no row after this many seconds")
    ap.add_argument("--out", type=Path, default=None, help="write rollouts.json here (default: --json's folder)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.repeats = 1
    if args.out is None and args.json is not None:
        args.out = args.json.parent
    result = run(args)
    if args.smoke and args.out is not None:  # the smoke runs the check here too, so it cannot rot either
        result["check"] = check(args.out, ["same", "float32"], args.threads)
        if not result["check"]["accepted"]:
            harness.write_json(args.json, result)
            return 1
    harness.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
