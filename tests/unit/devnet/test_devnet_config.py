"""The devnet's config: every shipped TOML parses, flags override it, and typos are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from devnet.config import load_config
from protocol.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs" / "devnet").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_parse(path: Path) -> None:
    cfg = load_config(["--config", str(path)])
    assert cfg.nodes >= 1 and cfg.validators >= 1


def test_flags_override_the_file_and_typos_are_refused() -> None:
    cfg = load_config(["--config", str(CONFIGS[0]), "--nodes", "2", "--model", "smollm2"])
    assert (cfg.nodes, cfg.model, cfg.validators) == (2, "smollm2", 3)
    with pytest.raises(ConfigError):
        load_config(["--nodez", "2"])


def test_init_takes_only_a_checkpoint_of_the_runs_model(tmp_path: Path) -> None:
    """`--init` (or `init` in the file): a checkpoint of the devnet's tiny model (another seed) is taken; one of
    another shape or a path that is no checkpoint is refused before anything starts, with the reason."""
    from devnet.network import TINY, DevnetError, Network
    from models.checkpoint import save_checkpoint
    from models.loading import load
    from protocol.model_spec import TinyModelSpec

    def saved(name: str, spec: dict[str, object]) -> Path:
        m = load(TinyModelSpec.model_validate(spec))
        return save_checkpoint(m.model, m.tokenizer, tmp_path / name)

    good = saved("good", {**TINY, "seed": 1})
    toml = tmp_path / "devnet.toml"
    toml.write_text(f'init = "{good}"\nstate_dir = "{tmp_path / "state"}"\n')
    assert Network(load_config(["--config", str(toml)])).init == good
    narrow = saved("narrow", {"type": "tiny", "seed": 1})
    for path, why in ((narrow, "hidden_size 64"), (tmp_path / "nowhere", "does not exist"),
                      (tmp_path, "no config.json")):
        with pytest.raises(DevnetError, match=f"--init .* cannot start a tiny run: .*{why}"):
            Network(load_config(["--init", str(path), "--state-dir", str(tmp_path / "state")]))
    inside = tmp_path / "state" / "ckpt"
    good.rename(inside)
    with pytest.raises(DevnetError, match="inside the state directory"):
        Network(load_config(["--init", str(inside), "--state-dir", str(tmp_path / "state")]))


def test_the_recipe_settings_reach_the_run_and_a_trainer_config_that_parses(tmp_path: Path) -> None:
    """What bench/learning.py passes for a recipe (`--run.temperature`, `--trainer.std-normalize`,
    `--trainer.warmup-steps`, `--trainer.eval.*`) lands in the run's rules and in the trainer's `[loss]`, `[optim]` and
    `[eval]` sections (on the run's environment and generation limit), which the trainer's config accepts."""
    from devnet.network import Network
    from protocol.rollout import RunSpec
    from trainer.config import TrainerConfig

    net = Network(load_config(["--state-dir", str(tmp_path / "state"), "--model", "smollm2", "--run.temperature",
                               "0.7", "--run.max-new-tokens", "48", "--trainer.std-normalize", "--trainer.warmup-steps",
                               "2", "--trainer.eval.every", "5", "--trainer.eval.temperatures", "0,1",
                               "--trainer.eval.num-tasks", "16"]))
    assert RunSpec.model_validate(net.run_spec).temperature == 0.7
    section = net._trainer_eval()
    assert section == {"eval": {"every": 5, "env": "reverse-text", "seed_start": 1_000_000, "num_tasks": 16,
                                "samples_per_task": 1, "temperatures": [0.0, 1.0], "max_new_tokens": 48, "seed": 0}}
    cfg = TrainerConfig.model_validate({
        **section, "loss": net.trainer_loss(), "optim": net.trainer_optim(),
        "data": {"type": "validators", "urls": ["http://127.0.0.1:1"], "addresses": ["0x" + "11" * 20],
                 "domain": "prime/1/0x0000000000000000000000000000000000000001/devnet"}})
    assert (cfg.loss.temperature, cfg.loss.std_normalize, cfg.optim.warmup_steps) == (0.7, True, 2)
    assert cfg.eval.temperatures == [0.0, 1.0] and cfg.eval.env == "reverse-text"
    off = Network(load_config(["--state-dir", str(tmp_path / "off")]))
    assert off._trainer_eval() == {} and off.trainer_loss() == {"temperature": 1.0, "std_normalize": False}


def test_weights_are_published_in_the_dtype_the_nodes_serve_unless_set() -> None:
    """Issue 37 item 1: `trainer.publish_dtype = auto` (the default) publishes in the nodes' dtype: float32 for the
    cpu engine (the tiny model, CPU runs), bfloat16 for vLLM; an explicit dtype wins."""
    assert load_config([]).publish_dtype() == "float32"
    assert load_config(["--model", "smollm2"]).publish_dtype() == "float32"  # the cpu engine computes in fp32
    assert load_config(["--node-engine", "vllm", "--model", "smollm2"]).publish_dtype() == "bfloat16"
    assert load_config(["--trainer.publish-dtype", "bfloat16"]).publish_dtype() == "bfloat16"
    assert load_config(["--node-engine", "vllm", "--trainer.publish-dtype", "float32"]).publish_dtype() == "float32"
