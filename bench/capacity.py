"""A capacity model past one machine, from this repository's measured per-role costs (bench/measured/*.json).

    python -m bench.capacity [--params 7e9] [--fanout 4 8 16 32] [--json PATH] [--smoke] [--measured DIR]

It measures nothing itself: it reads the numbers the other benchmarks recorded and answers, for networks of
100, 1,000 and 10,000 GPU nodes,

1. validators: how many validator GPUs keep up with the nodes' work (the larger of the compute bound, from
   validation time over generation time of the same rollouts, `validator.json`, and the intake bound, from the
   submissions per second one validator's HTTP intake takes, `validator.json`), at least 2 (failover);
2. relays and checkpoint time: the relays a SHARDCAST tree of fan-out k needs to reach every node and validator,
   and how long a 62 GB checkpoint takes to reach the last one, pipelined (a relay forwards each shard as soon
   as it has it), from one relay's measured egress (`load.json`, `shardcast.json`) and, for comparison, 1 and
   10 Gbit/s links;
3. chain: gas and ETH per accepted batch (the reporter's `recordWorkBatch` share, the trainer's `publishPolicy`
   spread over a step's batches, the node's `claimRewards` share: `gas.json`), and the share of a chain's gas
   throughput the network would use;
   and, for a version sent as a sparse delta (`shardcast/delta.py`), the bytes and time per version for an
   input changed fraction (`--delta-fraction`, default 1 %, 5 %, 10 %; measured on SmolLM2-135M only: 0.7 % per
   step at lr 2e-6, 3.5 % at 2e-5, `bench.shardcast --delta --train-lrs`);
4. gossip: seconds for a policy announcement to reach every node (per-hop latency from `discovery.json`);
5. trainer: trainer devices per node device (train tokens/s over generation tokens/s, `trainer.json`,
   `node.json`).

Every answer names the measured numbers it rests on (file and key) and the assumptions it adds; the
`limits` list says where the model stops being trustworthy. A file that is missing makes the answers that
need it `null`, never a guess. `--smoke` answers one network size (seconds; run by a default-tier test).
There is no anchor run: the inputs are the other benchmarks' measurements, each against its own anchor.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import harness

MEASURED = Path(__file__).resolve().parent / "measured"
NETWORKS = (100, 1_000, 10_000)
CHECKPOINT_GB = 62.0
"""The checkpoint size asked about (a 32B-parameter model in bf16 is ~64 GB)."""
MIB = 1 << 20


@dataclass(frozen=True)
class Measured:
    """One number read from a measurement file."""

    value: float
    source: str
    """`file:key.path` it was read from."""


class Inputs:
    """The measured numbers the model uses (None where the file or key is missing)."""

    def __init__(self, measured: Path) -> None:
        self.dir = measured
        self._files: dict[str, Any] = {}
        self.used: dict[str, Measured | None] = {}
        # validation (batched prefill + TOPLOC + sampling replay) over generation of the same rollouts, same machine
        self.check_over_gen = self._first("check_over_gen", ("validator.json", "validation_over_generation.smollm2"),
                                          ("validator.json", "validation_over_generation.tiny"))
        self.intake_per_s = self._first("intake_per_s", ("validator.json", "http_intake.per_s"),
                                        ("validator.json", "cheap_checks_per_s.smollm2"))
        rollout_tokens = self._get("validator.json", "models.smollm2.rollout_tokens")
        submissions = self._get("validator.json", "models.smollm2.submissions")
        self.tokens_per_submission = (Measured(rollout_tokens.value / submissions.value,
                                               f"{rollout_tokens.source} / {submissions.source}")
                                      if rollout_tokens and submissions else None)
        self.used["tokens_per_submission"] = self.tokens_per_submission
        self.relay_mib_s = self._relay_egress()
        self.shard_mib = self._first("shard_mib", ("shardcast.json", "shard_mib"))
        self.gas = self._gas()
        self.hop_s = self._hop_latency()
        self.train_over_gen = self._train_over_gen()

    # -- reading ----------------------------------------------------------------------------------------------

    def _file(self, name: str) -> Any:
        if name not in self._files:
            try:
                self._files[name] = json.loads((self.dir / name).read_text())
            except (OSError, ValueError):
                self._files[name] = None
        return self._files[name]

    def _get(self, name: str, path: str) -> Measured | None:
        node = self._file(name)
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        if not _num(node):
            return None
        return Measured(float(node), f"{name}:{path}")

    def _first(self, label: str, *where: tuple[str, str]) -> Measured | None:
        for name, path in where:
            m = self._get(name, path)
            if m is not None:
                self.used[label] = m
                return m
        self.used[label] = None
        return None

    def _relay_egress(self) -> Measured | None:
        """MiB/s one relay sends: the lower of the relay load test (one relay, 100 pulls) and the broadcast bench
        (clients x size through its relays)."""
        found = []
        one = self._get("load.json", "relay.throughput_mib_s")
        if one:
            found.append(one)
        sc = self._file("shardcast.json")
        if isinstance(sc, dict):
            size, clients, relays, secs = (self._get("shardcast.json", k) for k in ("size_mib", "clients", "relays",
                                                                                      "ours_s"))
            if size and clients and relays and secs:
                found.append(Measured(size.value * clients.value / relays.value / secs.value,
                                      "shardcast.json:size_mib x clients / relays / ours_s"))
        best = min(found, key=lambda m: m.value) if found else None
        self.used["relay_mib_s"] = best
        return best

    def _gas(self) -> dict[str, Measured] | None:
        data = self._file("gas.json")
        raw = data.get("rows") if isinstance(data, dict) else None
        rows = {r["call"]: r for r in (raw if isinstance(raw, list) else [])
                if isinstance(r, dict) and isinstance(r.get("call"), str) and _num(r.get("gas"))
                and _num(r.get("items")) and _num(r.get("gas_per_item"))}
        batch = next((r for k, r in rows.items() if isinstance(k, str) and k.startswith("recordWorkBatch (")
                      and "resent" not in k), None)
        single, publish = rows.get("recordWork"), rows.get("publishPolicy")
        claim = next((r for k, r in rows.items() if isinstance(k, str) and k.startswith("claimRewards (")
                      and r.get("items", 1) > 1), None)
        if not (batch and single and publish and claim):
            self.used["gas"] = None
            return None
        n = int(batch["items"])
        if n < 2:
            self.used["gas"] = None
            return None
        marginal = (batch["gas"] - single["gas"]) / (n - 1)  # one more work key in a batch
        out = {
            "record_fixed": Measured(single["gas"] - marginal, f"gas.json: recordWork - marginal ({batch['call']})"),
            "record_per_key": Measured(marginal, f"gas.json: ({batch['call']} - recordWork) / {n - 1}"),
            "publish_policy": Measured(float(publish["gas"]), "gas.json: publishPolicy"),
            "claim_per_key": Measured(float(claim["gas_per_item"]), f"gas.json: {claim['call']} gas_per_item"),
        }
        self.used.update({f"gas.{k}": v for k, v in out.items()})
        return out

    def _hop_latency(self) -> Measured | None:
        """Seconds per gossip hop: each measured mesh's p50 reach over its diameter (the bench's dial rule: host i
        dials i-1 and i//2), the worst of the sizes measured."""
        data = self._file("discovery.json")
        reach = data.get("reach") if isinstance(data, dict) else None
        if not isinstance(reach, dict) or not reach:
            self.used["hop_s"] = None
            return None
        worst: Measured | None = None
        for key, r in reach.items():
            try:
                hosts, p50 = int(r["hosts"]), float(r["ours"]["p50_s"])
            except (KeyError, TypeError, ValueError):
                continue
            if not (2 <= hosts <= 4096 and _num(p50)):
                continue
            per_hop = p50 / max(1, _diameter(hosts))
            if worst is None or per_hop > worst.value:
                worst = Measured(per_hop, f"discovery.json:reach.{key}.ours.p50_s / diameter {_diameter(hosts)}")
        self.used["hop_s"] = worst
        return worst

    def _train_over_gen(self) -> Measured | None:
        """Trainer tokens/s per torch thread over the node loop's generated tokens/s per thread (SmolLM2, CPU)."""
        train, threads = self._get("trainer.json", "train_tokens_per_s"), self._get("trainer.json", "threads")
        data = self._file("node.json")
        results = data.get("results") if isinstance(data, dict) else None
        row = next((r for r in (results if isinstance(results, list) else [])
                    if isinstance(r, dict) and r.get("model") == "smollm2"), None)
        if not (train and threads and row and _num(row.get("loop_tok_s")) and _num(row.get("threads"))):
            self.used["train_over_gen"] = None
            return None
        m = Measured((train.value / threads.value) / (float(row["loop_tok_s"]) / float(row["threads"])),
                     "trainer.json:train_tokens_per_s/threads over node.json:results[smollm2].loop_tok_s/threads")
        self.used["train_over_gen"] = m
        return m


def _num(v: Any) -> bool:
    """A finite positive number (what every measured input must be)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _diameter(hosts: int) -> int:
    """Diameter of `bench.discovery`'s mesh: host i dials i-1 and i//2."""
    adj: dict[int, set[int]] = {i: set() for i in range(hosts)}
    for i in range(1, hosts):
        for j in (i - 1, i // 2):
            adj[i].add(j)
            adj[j].add(i)
    best = 0
    for s in range(hosts):
        dist = {s: 0}
        frontier = [s]
        while frontier:
            nxt = []
            for u in frontier:
                for v in adj[u]:
                    if v not in dist:
                        dist[v] = dist[u] + 1
                        nxt.append(v)
            frontier = nxt
        best = max(best, max(dist.values()))
    return best


# -- the model ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Assumptions:
    """What the model adds to the measurements (each a flag)."""

    params: float
    bytes_per_param: float
    gpu_mem_gb: float
    node_tok_s: float
    utilization: float
    check_fraction: float
    batch_keys: int
    submissions_per_step: int
    gas_price_gwei: float
    chain_gas_per_s: float
    gossip_degree: int
    checkpoint_gb: float
    delta_fractions: tuple[float, ...] = ()
    anchor_every: int = 8


def delta_position_bytes(fraction: float) -> float:
    """Mean bytes of one changed element's position in a delta (`shardcast/delta.py`: the gap from the changed
    element before, in LEB128, 7 bits a byte), when `fraction` of the elements changed at random places: a gap is
    geometric with mean 1 / fraction and takes a byte more for each power of 128 it reaches."""
    return 1.0 + sum((1.0 - fraction) ** (128 ** k - 1) for k in range(1, 10))


def delta_bytes_over_full(fraction: float, bytes_per_param: float) -> float:
    """A delta's size over the full weights when `fraction` of the elements changed: each changed element costs its
    position and its new value; past the full size the trainer publishes an anchor instead."""
    return min(1.0, fraction * (delta_position_bytes(fraction) + bytes_per_param) / bytes_per_param)


TRAIN_BYTES_PER_PARAM = 16
"""bf16 weights and gradients, fp32 master weights and two Adam moments (FSDP shards them over the devices)."""
REFERENCE_PARAMS = 7e9
"""--node-tok-s is given for a model of this size and scaled by REFERENCE_PARAMS / params (decoding ~ params)."""


def node_tokens_per_s(a: Assumptions) -> float:
    return a.node_tok_s * REFERENCE_PARAMS / a.params


def relay_tree(consumers: int, k: int) -> tuple[int, int]:
    """(relays, hops from the origin to a consumer) of a tree where every server (origin or relay) feeds at most
    k children and consumers hang off the last level."""
    level = math.ceil(consumers / k)
    relays, hops = 0, 1
    while True:
        relays += level
        hops += 1
        if level <= k:  # the origin feeds this level directly
            return relays, hops
        level = math.ceil(level / k)


def checkpoint_seconds(size_mib: float, k: int, hops: int, egress_mib_s: float, shard_mib: float) -> float:
    """Pipelined: the slowest server sends the checkpoint to k children sharing its egress; each further hop adds
    one shard's time at that rate."""
    per_child = egress_mib_s / k
    return size_mib / per_child + (hops - 1) * shard_mib / per_child


def answer(n: int, k_values: Sequence[int], a: Assumptions, inp: Inputs) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": n}
    node_tok_s = node_tokens_per_s(a)
    sub_rate = (n * node_tok_s / inp.tokens_per_submission.value) if inp.tokens_per_submission else None
    # 1. validators
    compute = (math.ceil(n * inp.check_over_gen.value * a.check_fraction / a.utilization)
               if inp.check_over_gen else None)
    intake = (math.ceil(sub_rate * a.check_fraction / (inp.intake_per_s.value * a.utilization))
              if inp.intake_per_s and sub_rate is not None else None)
    gpus_per_validator = math.ceil(a.params * a.bytes_per_param / (a.gpu_mem_gb * 1e9 * 0.8))
    validators = max(2, compute or 0, intake or 0) if compute is not None or intake is not None else None
    out["validators"] = {"count": validators, "compute_bound": compute, "intake_bound": intake,
                         "gpus_each": gpus_per_validator,
                         "gpus": validators * gpus_per_validator if validators is not None else None,
                         "submissions_per_s": round(sub_rate, 1) if sub_rate is not None else None}
    # 2. relays and the checkpoint
    consumers = n + (validators or 0)
    size_mib = a.checkpoint_gb * 1e9 / MIB
    shard = inp.shard_mib.value if inp.shard_mib else 32.0
    trees = []
    for k in k_values:
        relays, hops = relay_tree(consumers, k)
        row: dict[str, Any] = {"fanout": k, "relays": relays, "hops": hops}
        for label, egress in (("measured", inp.relay_mib_s.value if inp.relay_mib_s else None),
                              ("1gbit", 1e9 / 8 / MIB), ("10gbit", 10e9 / 8 / MIB)):
            row[f"seconds_{label}"] = (round(checkpoint_seconds(size_mib, k, hops, egress, shard), 1)
                                       if egress else None)
        trees.append(row)
    out["relays"] = trees
    deltas = []
    for fraction in a.delta_fractions:
        ratio = delta_bytes_over_full(fraction, a.bytes_per_param)
        delta_mib = size_mib * ratio
        row_d: dict[str, Any] = {
            "changed_fraction": fraction, "bytes_over_full": round(ratio, 4),
            "gb_per_delta": round(a.checkpoint_gb * ratio, 3),
            # an anchor every `anchor_every` versions, deltas between
            "gb_per_version": round(a.checkpoint_gb * ((a.anchor_every - 1) * ratio + 1) / a.anchor_every, 3),
            "relays": []}
        for k in k_values:
            _, hops = relay_tree(consumers, k)
            times: dict[str, Any] = {"fanout": k}
            for label, egress in (("measured", inp.relay_mib_s.value if inp.relay_mib_s else None),
                                  ("1gbit", 1e9 / 8 / MIB), ("10gbit", 10e9 / 8 / MIB)):
                times[f"seconds_{label}"] = (round(checkpoint_seconds(delta_mib, k, hops, egress,
                                                                      min(shard, delta_mib)), 1) if egress else None)
            row_d["relays"].append(times)
        deltas.append(row_d)
    out["delta"] = deltas
    # 3. chain
    if inp.gas:
        g = inp.gas
        per_batch = (g["record_fixed"].value / a.batch_keys + g["record_per_key"].value
                     + g["publish_policy"].value / a.submissions_per_step + g["claim_per_key"].value)
        chain_rate = (sub_rate * per_batch / a.chain_gas_per_s) if sub_rate is not None else None
        out["chain"] = {"gas_per_accepted_batch": round(per_batch),
                        "eth_per_accepted_batch": per_batch * a.gas_price_gwei * 1e-9,
                        "share_of_chain_gas": round(chain_rate, 4) if chain_rate is not None else None}
    else:
        out["chain"] = None
    # 4. gossip
    hops = max(1, math.ceil(math.log(max(n, 2)) / math.log(a.gossip_degree)))
    out["gossip"] = {"hops": hops, "seconds": round(hops * inp.hop_s.value, 3) if inp.hop_s else None}
    # 5. trainer
    # 5. trainer: keep up with the nodes' tokens, and hold the model with Adam (~16 bytes per parameter, sharded)
    memory_floor = math.ceil(a.params * TRAIN_BYTES_PER_PARAM / (a.gpu_mem_gb * 1e9 * 0.8))
    throughput = math.ceil(n / inp.train_over_gen.value / a.utilization) if inp.train_over_gen else None
    out["trainer"] = {"devices": max(throughput, memory_floor) if throughput is not None else None,
                      "throughput_bound": throughput, "memory_floor": memory_floor}
    return out


LIMITS = [
    "validation over generation (validator.json) was measured on a 2-core CPU, where decoding and prefill are both "
    "compute-bound; on a GPU, decoding is memory-bound and prefill is not, so the real ratio is lower and the "
    "compute bound here overestimates validators (measure it on the GPU you will run: python -m bench.validator)",
    "the ratio is taken as independent of model size (both passes cost ~2 x params FLOPs per token); long "
    "prompts shift it towards validation (the prefill re-reads the prompt: prompt_share_of_check_prefill)",
    "node tokens/s on a GPU is an assumption (--node-tok-s), not a measurement here: it sets the submission "
    "rate, hence the intake bound and the chain's load",
    "relay egress (load.json, shardcast.json) is loopback on a shared 2-core box, CPU-bound; across machines the "
    "link is the bound (the 1 and 10 Gbit/s columns), and latency, loss and TCP slow start are not modelled",
    "the relay tree is ideal (every relay full, no failures, no stragglers); clients that pull from several relays "
    "at once finish sooner, slow or lying relays later",
    "gas is anvil's (cancun) for this contract build; ETH cost = gas x --gas-price-gwei and ignores L1 data fees "
    "of rollups; the chain-load share assumes every accepted batch is recorded as its own work key",
    "the delta rows take the changed fraction per version as an input (--delta-fraction): measured on SmolLM2-135M "
    "only (0.7 % per step at lr 2e-6, 3.5 % at 2e-5: bench/measured/shardcast_delta_smollm2_8steps.json), not on a "
    "62 GB model; a delta's bytes are that fraction x (the position's gap, 1-2 bytes in LEB128 at these fractions, "
    "+ the value) per element, the gaps taken as geometric (changed elements at random places); clustered changes "
    "make gaps shorter, so this is the conservative side",
    "gossip per hop comes from at most 16 libp2p hosts in one process on 2 cores (CPU-bound); hops = "
    "ceil(log N / log D) assumes a well-mixed mesh of degree D",
    "trainer devices per node device (the throughput bound) is CPU-measured (training is matmul-bound, generation here too); on GPUs "
    "training runs much nearer peak than decoding, so this overestimates trainer devices",
]


def table(result: dict[str, Any]) -> str:
    lines = []
    a = result["assumptions"]
    lines.append(f"model {a['params']:.3g} params x {a['bytes_per_param']} B, node {result['node_tok_s']:,.0f} tok/s "
                 f"(assumed), {a['utilization']:.0%} utilization, {a['check_fraction']:.0%} of submissions checked, "
                 f"{a['checkpoint_gb']:g} GB checkpoint")
    lines.append(f"{'nodes':>6} {'validators':>10} {'(compute/intake)':>16} {'val.GPUs':>8} {'sub/s':>8} "
                 f"{'gas/batch':>9} {'chain%':>7} {'gossip s':>8} {'trainer':>7}")
    for r in result["networks"]:
        v, c = r["validators"], r["chain"] or {}
        share = c.get("share_of_chain_gas")
        lines.append(f"{r['nodes']:>6} {_s(v['count']):>10} {_s(v['compute_bound']) + '/' + _s(v['intake_bound']):>16} "
                     f"{_s(v['gpus']):>8} {_s(v['submissions_per_s']):>8} {_s(c.get('gas_per_accepted_batch')):>9} "
                     f"{(f'{share:.0%}' if share is not None else '-'):>7} {_s(r['gossip']['seconds']):>8} "
                     f"{_s(r['trainer']['devices']):>7}")
    lines.append("")
    lines.append(f"{'nodes':>6} {'k':>3} {'relays':>6} {'hops':>4} {'seconds (measured)':>18} {'1 Gbit/s':>9} "
                 f"{'10 Gbit/s':>9}")
    for r in result["networks"]:
        for t in r["relays"]:
            lines.append(f"{r['nodes']:>6} {t['fanout']:>3} {t['relays']:>6} {t['hops']:>4} "
                         f"{_s(t['seconds_measured']):>18} {_s(t['seconds_1gbit']):>9} {_s(t['seconds_10gbit']):>9}")
    if any(r.get("delta") for r in result["networks"]):
        lines.append("")
        lines.append(f"delta versions (changed fraction an input, --delta-fraction; an anchor every {a['anchor_every']}): "
                     "seconds to every node, measured egress / 10 Gbit/s")
        ks = [t["fanout"] for t in result["networks"][0]["relays"]]
        lines.append(f"{'nodes':>6} {'changed':>7} {'delta/full':>10} {'GB/delta':>8} {'GB/version':>10} "
                     + " ".join(f"{'k=' + str(k):>15}" for k in ks))
        for r in result["networks"]:
            for d in r["delta"]:
                cells = " ".join(f"{_s(t['seconds_measured']) + ' / ' + _s(t['seconds_10gbit']):>15}"
                                 for t in d["relays"])
                lines.append(f"{r['nodes']:>6} {d['changed_fraction']:>7.0%} {d['bytes_over_full']:>10.3f} "
                             f"{d['gb_per_delta']:>8.2f} {d['gb_per_version']:>10.2f} {cells}")
    lines.append("")
    lines.append("rests on:")
    for k, m in result["inputs"].items():
        shown = f"{m['value']:.4g}" if m else "MISSING"
        lines.append(f"  {k:<24} {shown:>12}  {m['source'] if m else ''}")
    return "\n".join(lines)


def _s(v: Any) -> str:
    return "-" if v is None else (f"{v:,.1f}" if isinstance(v, float) else f"{v:,}")


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(__doc__, smoke="one network size, one fan-out (seconds)",
                       quick="the same as a full run (the model is instant)",
                       json_help="write the answers, inputs and limits here")
    p.add_argument("--measured", type=Path, default=MEASURED, help="directory of the measurement files")
    p.add_argument("--nodes", type=int, nargs="+", default=list(NETWORKS), help="network sizes (GPU nodes)")
    p.add_argument("--fanout", type=int, nargs="+", default=[4, 8, 16, 32], help="relay fan-outs k")
    p.add_argument("--params", type=float, default=7e9, help="model parameters (validator memory)")
    p.add_argument("--bytes-per-param", type=float, default=2.0, help="2 for bf16")
    p.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory of one validator GPU")
    p.add_argument("--node-tok-s", type=float, default=1500.0,
                   help="ASSUMED generated tokens/s of one GPU node for a 7B model, scaled by 7e9 / --params (sets the "
                        "submission rate)")
    p.add_argument("--checkpoint-gb", type=float, default=CHECKPOINT_GB, help="checkpoint broadcast through the relays")
    p.add_argument("--utilization", type=float, default=0.8, help="target busy share of a validator / trainer")
    p.add_argument("--check-fraction", type=float, default=1.0,
                   help="share of submissions fully checked (1.0: every one, as the validator does today)")
    p.add_argument("--batch-keys", type=int, default=20, help="work keys per recordWorkBatch (the reporter's batch)")
    p.add_argument("--submissions-per-step", type=int, default=64, help="accepted batches per trainer step")
    p.add_argument("--gas-price-gwei", type=float, default=1.0, help="gas price for the ETH column")
    p.add_argument("--chain-gas-per-s", type=float, default=2.5e6,
                   help="gas per second the chain executes (Ethereum mainnet: 30M per 12 s block)")
    p.add_argument("--gossip-degree", type=int, default=6, help="gossipsub mesh degree D")
    p.add_argument("--delta-fraction", type=float, nargs="*", default=[0.01, 0.05, 0.10],
                   help="share of the weights' elements one RL step changes (SmolLM2-135M measured 0.7 %% at lr 2e-6, "
                        "3.5 %% at 2e-5): the delta rows")
    p.add_argument("--anchor-every", type=int, default=8,
                   help="a full anchor every N versions, deltas between (the trainer's publish.anchor_every)")
    args = p.parse_args(argv)
    if args.smoke:
        args.nodes, args.fanout = args.nodes[:1], args.fanout[:1]
    if not (args.params > 0 and args.node_tok_s > 0 and args.checkpoint_gb > 0 and args.gpu_mem_gb > 0) or not (
            0 < args.utilization <= 1 and 0 < args.check_fraction <= 1) or min(args.fanout) < 2 or min(
            args.nodes) < 1 or args.gossip_degree < 2 or args.batch_keys < 1 or args.submissions_per_step < 1 or not all(
            0 < f <= 1 for f in args.delta_fraction) or args.anchor_every < 1:
        p.error("utilization, check and delta fractions in (0, 1], fan-out >= 2, nodes >= 1, degree >= 2, "
                "batches >= 1, anchor every >= 1")
    inp = Inputs(args.measured)
    a = Assumptions(params=args.params, bytes_per_param=args.bytes_per_param, gpu_mem_gb=args.gpu_mem_gb,
                    node_tok_s=args.node_tok_s, utilization=args.utilization, check_fraction=args.check_fraction,
                    batch_keys=args.batch_keys, submissions_per_step=args.submissions_per_step,
                    gas_price_gwei=args.gas_price_gwei, chain_gas_per_s=args.chain_gas_per_s,
                    gossip_degree=args.gossip_degree, checkpoint_gb=args.checkpoint_gb,
                    delta_fractions=tuple(args.delta_fraction), anchor_every=args.anchor_every)
    result = {
        "bench": "capacity", "smoke": args.smoke, "measured_dir": str(args.measured),
        "assumptions": asdict(a), "node_tok_s": node_tokens_per_s(a),
        "inputs": {k: (asdict(m) if m else None) for k, m in inp.used.items()},
        "networks": [answer(n, args.fanout, a, inp) for n in args.nodes],
        "limits": LIMITS,
    }
    try:
        print(table(result))
    except BrokenPipeError:  # `| head`
        pass
    harness.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
