"""The GPU path's dry run on this CPU (issue 38), in the default tier so the device command cannot rot between the
rare runs on a GPU machine: `make gpu-bundle`'s builder makes a bundle (tiny model, smoke-sized inputs), the
device program runs FROM it (cwd the repository root, as on the GPU machine) with the device command's
`python -P -s` plus `-S` and only a stand-in for the GPU machine's packages on its path
(`bench.gpu_bundle.device_site`: torch, transformers, ... and their dependencies; no eth-account, web3, FastAPI
or vLLM, and pydantic only as the bundle ships it), and the CPU validator's check (`bench.gpu check`, the
validator's own `judge`) accepts what it made. Select it with `pytest -k 'gpu and dry'`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu, gpu_bundle

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(300)
def test_gpu_program_dry_run_on_cpu_passes_the_cpu_validator(tmp_path: Path) -> None:
    cached = all(any(gpu_bundle.WHEEL_CACHE.glob(f"{p.split('==')[0].replace('-', '_')}-{p.split('==')[1]}-*.whl"))
                 for p in gpu_bundle.wheel_pins()) if gpu_bundle.WHEEL_CACHE.is_dir() else False
    bundle = tmp_path / "bundle"
    # The wheels travel only where `make gpu-bundle` fetched them once (no registry in a test).
    manifest = gpu_bundle.build(bundle, offline=True, size="smoke", with_wheels=cached)
    assert manifest["bundle_bytes"] < gpu_bundle.LIMIT_BYTES
    assert {f.split("/")[1] for f in manifest["files"] if f.startswith("src/")} == {*gpu_bundle.PACKAGES, "bench"}
    if cached:
        assert len(manifest["wheels"]) == len(gpu_bundle.WHEELS) and all(map(gpu_bundle.wheel_ok, manifest["wheels"]))
    assert manifest["command"].startswith("PYTHONPATH=.gpu-bundle/src:.gpu-bundle/site python3 -P -s -m bench.gpu")

    # Python here is not 3.12, so the bundle's pydantic_core cannot load: the installed pydantic stands in for it.
    site = tmp_path / "device-site"
    names = gpu_bundle.device_site(site, stand_ins=sys.version_info[:2] != (3, 12))
    assert not {"eth-account", "eth-utils", "web3", "fastapi", "vllm", "prime-network"} & set(names)
    out, imports = tmp_path / "out", tmp_path / "imports.json"
    # The device command's interpreter flags (-P: not the working tree's folders), plus -S: no site-packages at all,
    # so only the bundle and the stand-in are importable. The wrapper records where every module came from.
    program = ("import atexit, json, runpy, sys; atexit.register(lambda: open("
               f"{str(imports)!r}, 'w').write(json.dumps({{n: getattr(m, '__file__', None) for n, m in "
               "list(sys.modules.items())}))); runpy.run_module('bench.gpu', run_name='__main__', alter_sys=True)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=os.pathsep.join([str(bundle / "src"), str(site)]), OMP_NUM_THREADS="1")
    command = manifest["command"].split(" -m bench.gpu ", 1)
    assert command[0].endswith("python3 -P -s") and command[1].startswith("--device cuda")
    proc = subprocess.run(
        [sys.executable, "-P", "-s", "-S", "-c", program, "--device", "cpu", "--inputs", str(bundle / "inputs.json"),
         "--repeats", "1", "--threads", "1", "--json", str(out / "gpu.json"), "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    modules = json.loads(imports.read_text())
    own = {n: f for n, f in modules.items() if n.split(".")[0] in ("bench", "models", "toploc", "protocol")}
    # bench.gpu itself ran as __main__ from `bench`'s folder (runpy restores __main__ before atexit)
    assert {"bench", "bench.harness", "models.engine", "toploc.validation", "protocol.model_spec"} <= set(own)
    assert all(f is None or Path(f).is_relative_to(bundle / "src") for f in own.values()), own
    assert "protocol.seeds" not in own and "protocol.identity" not in own  # the inputs carry the seeds
    result = json.loads((out / "gpu.json").read_text())
    assert [(r["model"], r["dtype"]) for r in result["rows"]] == [("tiny", "bfloat16"), ("tiny", "float32")]
    for r in result["rows"]:
        assert r["engine_tok_s"] > 0 and r["hf_tok_s"] > 0 and r["check_s"] > 0
        assert r["device_margins"]["failing_chunks"] == 0 and r["device_margins"]["sampling_mismatches"] == 0

    checked = gpu.check(out, ["same", "float32"], 1)
    assert checked["accepted"], [(r["model"], r["generated_dtype"], r["validator_dtype"], r["verdict"])
                                 for r in checked["rows"]]
    assert [(r["generated_dtype"], r["validator_dtype"]) for r in checked["rows"]] == [
        ("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "float32")]
    for r in checked["rows"]:
        assert r["prompt_diffs"] == 0 and r["seed_diffs"] == 0 and r["failing_chunks"] == 0
        assert all(r["headroom"][k] >= 0 for k in r["worst"]), r["headroom"]
        assert all(s["toploc"] for s in r["samples_measured"])  # every chunk's measurement is in the JSON
