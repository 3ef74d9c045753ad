"""`python -m bench.learning --model smollm2` builds its two runs from one recipe: the local trainer's command line and the
devnet's parse into configs that agree on every learning setting (the recipe TOML's values, or the flags'), and a
recipe setting the devnet cannot pass on is refused before anything runs. Parses only; nothing is started."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from benchload import load_bench


def _bench() -> Any:
    return load_bench("learning")


def _configs(bench: Any, argv: list[str], tmp_path: Path) -> tuple[Any, Any, Any]:
    from devnet.config import load_config as load_devnet
    from devnet.network import Network
    from trainer.config import load_config as load_trainer

    tmp_path.mkdir(parents=True, exist_ok=True)
    args = bench.parser().parse_args(argv)
    r = bench.smollm2_recipe(args, str(tmp_path / "sft-model"))
    local = bench.local_cmd(tmp_path, r)
    assert local[:3] == [sys.executable, "-m", "trainer.cli"]
    trainer = load_trainer(local[3:])
    up = bench.devnet_cmd(tmp_path, r, 3, 2, 2)
    assert up[:4] == [sys.executable, "-m", "devnet.cli", "up"]
    net = Network(load_devnet(up[4:]))  # builds the run's rules; starts nothing (the --init path is not read yet)
    return r, trainer, net


def test_both_runs_get_the_recipe_from_the_toml_and_the_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench()
    from devnet import network

    monkeypatch.setattr(network, "check_init", lambda cfg, state: cfg.init)  # no checkpoint on disk here
    with bench.RL_TOML.open("rb") as fh:
        toml = tomllib.load(fh)
    r, local, net = _configs(bench, ["--model", "smollm2", "--init", "x"], tmp_path)
    assert (r.lr, r.groups_per_step, r.group_size, r.max_new_tokens, r.steps) == (
        toml["optim"]["lr"], toml["batch"]["groups_per_step"], toml["data"]["group_size"],
        toml["data"]["max_new_tokens"], toml["max_steps"])
    run, ev = net.run_spec, net._trainer_eval()["eval"]
    assert local.model.name_or_path == str(tmp_path / "sft-model") == str(net.init)
    assert local.data.type == "local" and local.data.env == net.env == "reverse-text"
    assert local.data.group_size == run["samples_per_task"] and local.data.max_new_tokens == run["max_new_tokens"]
    assert local.data.temperature == local.loss.temperature == run["temperature"] == net.trainer_loss()["temperature"]
    assert local.loss.std_normalize == net.trainer_loss()["std_normalize"] == toml["loss"]["std_normalize"]
    assert (local.optim.lr, local.optim.warmup_steps) == (net.trainer_optim()["lr"], net.trainer_optim()["warmup_steps"])
    assert local.batch.groups_per_step == net.groups_per_step and local.max_steps == net.cfg.trainer.max_steps
    for key in ("every", "seed_start", "num_tasks", "samples_per_task", "temperatures", "max_new_tokens", "seed"):
        assert getattr(local.eval, key) == ev[key], key
    assert local.eval.temperatures == [0.0, 1.0] and local.eval.seed_start == 1_000_000
    assert (net.cfg.nodes, net.cfg.validators, net.cfg.relays, net.cfg.trainer.async_level) == (3, 2, 2, 2)

    flags = ["--model", "smollm2", "--init", "x", "--lr", "3e-5", "--no-std-normalize", "--steps", "7", "--groups",
             "6", "--group-size", "4", "--max-new-tokens", "24", "--eval-every", "3", "--eval-tasks", "16"]
    r, local, net = _configs(bench, flags, tmp_path / "flags")
    assert (local.optim.lr, net.lr) == (3e-5, 3e-5) and not local.loss.std_normalize and not net.cfg.trainer.std_normalize
    assert (local.max_steps, net.cfg.trainer.max_steps, local.batch.groups_per_step, net.groups_per_step) == (7, 7, 6, 6)
    assert (local.data.group_size, net.run_spec["samples_per_task"]) == (4, 4)
    assert (local.eval.every, net.cfg.trainer.eval.every, local.eval.num_tasks, net.cfg.trainer.eval.num_tasks) == (
        3, 3, 16, 16)
    assert local.dtype == net.cfg.trainer.dtype == toml.get("dtype", "auto")
    r, local, net = _configs(bench, ["--model", "smollm2", "--init", "x", "--train-dtype", "bfloat16"], tmp_path / "bf16")
    assert local.dtype == net.cfg.trainer.dtype == "bfloat16"


def test_a_recipe_the_devnet_cannot_run_is_refused(tmp_path: Path) -> None:
    bench = _bench()
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(bench.RL_TOML.read_text().replace("epsilon_high = 0.28", "epsilon_high = 0.5"))
    with pytest.raises(SystemExit, match="loss.epsilon_high = 0.5"):
        bench.smollm2_recipe(bench.parser().parse_args(["--model", "smollm2", "--init", "x", "--recipe", str(recipe)]),
                             "x")


def test_the_multi_turn_recipe_runs_both_ways_on_calc_arith(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36's learning run: the calc-arith recipe passes the devnet check, and both runs play calc-arith's
    episodes with the recipe's per-turn limit, group and learning rate."""
    bench = _bench()
    from devnet import network

    monkeypatch.setattr(network, "check_init", lambda cfg, state: cfg.init)  # no checkpoint on disk here
    recipe = bench.REPO / "configs/trainer/calc-arith-smollm2-sft-rl.toml"
    with recipe.open("rb") as fh:
        toml = tomllib.load(fh)
    r, local, net = _configs(bench, ["--model", "smollm2", "--init", "x", "--recipe", str(recipe)], tmp_path)
    assert local.data.env == net.env == r.env == "calc-arith"
    assert local.data.max_new_tokens == net.run_spec["max_new_tokens"] == toml["data"]["max_new_tokens"]
    assert local.data.group_size == net.run_spec["samples_per_task"] == toml["data"]["group_size"]
    assert local.optim.lr == net.trainer_optim()["lr"] == toml["optim"]["lr"]
    assert local.max_steps == net.cfg.trainer.max_steps == toml["max_steps"]


def test_the_shipped_multi_turn_devnet_config_is_the_recipes_network_run(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`prime-devnet up --config configs/devnet/smollm2-calc-arith.toml` (README) runs what the bench measured:
    every learning setting of the file equals the devnet command `bench.learning` builds from the recipe."""
    bench = _bench()
    from devnet import network
    from devnet.config import load_config as load_devnet

    monkeypatch.setattr(network, "check_init", lambda cfg, state: cfg.init)
    recipe = bench.REPO / "configs/trainer/calc-arith-smollm2-sft-rl.toml"
    with recipe.open("rb") as fh:
        start = Path(tomllib.load(fh)["model"]["name_or_path"])  # the local run's start: the SFT's step-2 checkpoint
    _, _, net = _configs(bench, ["--model", "smollm2", "--init", "x", "--recipe", str(recipe)], tmp_path)
    shipped = network.Network(load_devnet(["--config", str(bench.REPO / "configs/devnet/smollm2-calc-arith.toml"),
                                            "--state-dir", str(tmp_path / "shipped")]))
    assert Path(str(shipped.init)) == start and shipped.cfg.model == net.cfg.model == "smollm2"
    assert (shipped.env, shipped.run_spec, shipped.groups_per_step) == (net.env, net.run_spec, net.groups_per_step)
    assert shipped.trainer_optim() == net.trainer_optim() and shipped.trainer_loss() == net.trainer_loss()
    assert shipped._trainer_eval() == net._trainer_eval()
    assert (shipped.cfg.trainer.max_steps, shipped.cfg.trainer.async_level) == (net.cfg.trainer.max_steps, 2)
    assert (shipped.cfg.nodes, shipped.cfg.validators, shipped.cfg.relays) == (3, 2, 2)
