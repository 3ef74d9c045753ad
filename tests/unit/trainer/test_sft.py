"""`prime-trainer sft` on the tiny model: completion-only loss, packing, exact resume, data files, the RL hand-off."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

import environments
from models import load
from protocol.errors import TrainerError
from protocol.model_spec import HFModelSpec, TinyModelSpec
from trainer.cli import main
from trainer.config import SFTConfig, TrainerConfig, load_config, load_sft_config
from trainer.packing import pack_examples, token_logprobs
from trainer.sft import SFTTrainer, run_sft, sft_loss
from trainer.sft_data import (
    SFTDataError,
    SFTDataset,
    build_dataset,
    conversation_from,
    held_out_env_seed,
    read_conversations,
    tokenize,
)

ROOT = Path(__file__).resolve().parents[3]
TINY = {"type": "tiny", "seed": 3, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2}


def _tiny() -> Any:
    return load(TinyModelSpec(**{k: v for k, v in TINY.items() if k != "type"}))


def _examples(loaded: Any, n: int, start: int = 0) -> SFTDataset:
    cfg = SFTConfig.model_validate({"data": {"type": "environment", "seed_start": start, "num_examples": n}})
    return build_dataset(cfg.data, loaded.tokenizer, loaded.eos_token_ids, 512, 0)


def _cfg(tmp: Path, **over: Any) -> SFTConfig:
    base: dict[str, Any] = {
        "model": TINY, "progress": False, "max_steps": 6, "seed": 1,
        "optim": {"lr": 1e-3, "warmup_steps": 2, "schedule": "cosine"},
        "batch": {"examples_per_step": 4, "seq_len": 512, "micro_batch_rows": 1},
        "data": {"type": "environment", "env": "reverse-text", "seed_start": 0, "num_examples": 10},
        "checkpoint": {"dir": str(tmp / "ck"), "interval": 1, "keep": 2},
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return SFTConfig.model_validate(base)


def test_loss_and_gradient_only_on_completion_tokens() -> None:
    loaded = _tiny()
    env = environments.get("reverse-text")
    task = env.task_from("hello world", "dlrow olleh")
    conv = conversation_from({"prompt": task.as_messages(), "completion": env.reference_completion(task)}, "t")
    ex = tokenize(loaded.tokenizer, conv, loaded.eos_token_ids)
    n_prompt = ex.loss_mask.index(True)
    assert not any(ex.loss_mask[:n_prompt]) and all(ex.loss_mask[n_prompt:])
    # The prompt is exactly what the node is given at RL time; the completion ends at the end-of-turn token.
    rendered = environments.render_prompt(loaded.tokenizer, task, tokenize=True)
    assert list(ex.tokens[:n_prompt]) == list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert loaded.tokenizer.decode(ex.tokens[n_prompt:]) == "<answer>dlrow olleh</answer><eos>"

    model = loaded.model.train().requires_grad_(True)
    packed = pack_examples([ex.tokens], [ex.loss_mask], [1.0 / ex.n_loss_tokens], 512).select([0])
    captured: list[torch.Tensor] = []

    def keep_logits(_mod: Any, _inp: Any, out: torch.Tensor) -> None:
        out.retain_grad()
        captured.append(out)

    handle = model.lm_head.register_forward_hook(keep_logits)
    try:
        loss, value = sft_loss(model, packed, torch.device("cpu"))
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        # Reference: logits at every position, the loss weights zero off the completion.
        lp, _ = token_logprobs(model, packed.input_ids, packed.position_ids, packed.segment_ids)
        full = -(lp * packed.weights).sum()
        full.backward()
    finally:
        handle.remove()
    assert captured[0].shape[:-1] == (ex.n_loss_tokens,)  # the LM head ran on completion positions only
    # The same number by hand: mean NLL of the completion tokens given their prefix.
    ids = torch.tensor([ex.tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        nll = -logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
    torch.testing.assert_close(loss.detach(), nll[n_prompt - 1:].mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(full.detach(), loss.detach(), rtol=1e-6, atol=1e-7)
    assert value == pytest.approx(float(loss.detach()))
    # Logits at position t predict token t + 1: every position predicting a prompt token gets no gradient.
    grad = captured[1].grad[0]
    assert float(grad[: n_prompt - 1].abs().max()) == 0.0
    assert bool((grad[n_prompt - 1 : len(ex.tokens) - 1].abs().amax(-1) > 0).all())
    for a, b in zip(grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_packed_rows_give_the_unpacked_loss_and_gradients(tmp_path: Path) -> None:
    loaded = _tiny()
    data = _examples(loaded, 7)
    examples = data.examples
    assert len({len(e.tokens) for e in examples}) > 1
    cfg = _cfg(tmp_path, batch={"examples_per_step": 7, "seq_len": 800, "micro_batch_rows": 2})

    def loss_and_grads(rows_of: list[list[int]] | None) -> tuple[float, list[torch.Tensor]]:
        model = _tiny().model
        trainer = SFTTrainer(cfg, model, data, torch.device("cpu"))
        total = sum(e.n_loss_tokens for e in examples)
        if rows_of is None:  # packed as the trainer packs a step
            packed = trainer.pack(examples)
            assert packed.input_ids.shape[0] < len(examples)
            micro = trainer._micro_batches(packed)
        else:  # every example alone in its own row
            micro = [pack_examples([examples[i].tokens], [examples[i].loss_mask], [1.0 / total],
                                   len(examples[i].tokens)) for (i,) in rows_of]
        value = 0.0
        for mb in micro:
            loss, v = sft_loss(trainer.model, mb, torch.device("cpu"))
            loss.backward()
            value += v
        return value, [p.grad.clone() for p in trainer.model.parameters()]

    packed_loss, packed_grads = loss_and_grads(None)
    alone_loss, alone_grads = loss_and_grads([[i] for i in range(len(examples))])
    assert packed_loss == pytest.approx(alone_loss, rel=1e-5)
    for a, b in zip(packed_grads, alone_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _losses(path: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in path.read_text().splitlines():
        m = json.loads(line)
        out[m["step"]] = m["loss"]
    return out


@pytest.mark.timeout(180)
def test_resume_is_bit_exact_and_the_export_loads(tmp_path: Path) -> None:
    # 10 examples, 4 a step: steps cross epoch boundaries (a new seeded order each epoch).
    a = _cfg(tmp_path / "a", metrics_file=str(tmp_path / "a.jsonl"), output_dir=str(tmp_path / "a-model"))
    run_sft(a)
    b = _cfg(tmp_path / "b", metrics_file=str(tmp_path / "b.jsonl"), max_steps=3)
    run_sft(b)
    run_sft(b.model_copy(update={"max_steps": 6}))  # a new process would do the same: resume from step-3
    la, lb = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "b.jsonl")
    assert sorted(la) == list(range(6)) and la == lb
    assert la[5] < la[0]  # it learns
    wa = load_file(tmp_path / "a" / "ck" / "step-6" / "model.safetensors")
    wb = load_file(tmp_path / "b" / "ck" / "step-6" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    state = json.loads((tmp_path / "b" / "ck" / "step-6" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["source"]["examples"] == 10

    # The export is a plain model directory: it loads through models/ with the same weights, no optimizer.
    export = tmp_path / "a-model"
    assert not (export / "optimizer.pt").exists()
    reloaded = load(HFModelSpec(name_or_path=str(export)))
    for name, t in reloaded.model.state_dict().items():
        assert torch.equal(t, wa[name]), name

    # Resuming on other data is refused before a step is taken.
    other = b.model_copy(update={"max_steps": 8, "data": a.data.model_copy(update={"seed_start": 500})})
    with pytest.raises(TrainerError, match="other SFT data"):
        run_sft(other)


@pytest.mark.timeout(120)
def test_rl_starts_from_the_sft_output(tmp_path: Path) -> None:
    run_sft(_cfg(tmp_path, max_steps=2, output_dir=str(tmp_path / "sft-model")))
    from trainer.runner import run

    rl = TrainerConfig.model_validate({
        "model": {"type": "hf", "name_or_path": str(tmp_path / "sft-model")},
        "max_steps": 1, "progress": False, "metrics_file": str(tmp_path / "rl.jsonl"),
        "batch": {"groups_per_step": 2, "seq_len": 512, "async_level": 0},
        "data": {"type": "local", "env": "reverse-text", "group_size": 2, "max_new_tokens": 4},
        "checkpoint": {"dir": str(tmp_path / "rl-ck")},
    })
    run(rl)
    assert json.loads((tmp_path / "rl.jsonl").read_text())["step"] == 0
    assert (tmp_path / "rl-ck" / "step-1" / "model.safetensors").is_file()


def _write_jsonl(path: Path, records: list[Any]) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


GOOD = [
    {"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}]},
    {"prompt": "count to 3", "completion": "1 2 3"},
    {"prompt": [{"role": "system", "content": "be short"}, {"role": "user", "content": "yes?"}],
     "completion": [{"role": "assistant", "content": "yes"}]},
]


@pytest.mark.parametrize("name", ["calc-arith", "alphabet-sort", "wordle"])
def test_a_multi_turn_environment_gives_its_reference_episodes_trained_on_the_model_turns(name: str) -> None:
    """Issue 36 item 7: the SFT warm-up of a multi-turn environment is its reference episodes, rendered as the
    network renders an episode (the environment's replies as tokens, never re-tokenizing the model's turns), the
    loss on the model's turns only; each reference episode wins (it is what the warm-up teaches)."""
    loaded = _tiny()
    env = environments.get(name)
    cfg = SFTConfig.model_validate({"data": {"type": "environment", "env": name, "seed_start": 40,
                                             "num_examples": 4}})
    data = build_dataset(cfg.data, loaded.tokenizer, loaded.eos_token_ids, 4096, 0)
    renderer = environments.ChatRenderer(loaded.tokenizer)
    assert len(data) == 4
    for seed, example in enumerate(data.examples, 40):
        task = env.sample(seed, 1)[0]
        turns = env.reference_episode(task, held_out_env_seed(seed))
        played = environments.render_episode(renderer, env, task, held_out_env_seed(seed),
                                             [renderer.encode(t) + [renderer.eos_id] for t in turns])
        # it ends solved: calc-arith and alphabet-sort score 1; wordle's partial credit pays fewer guesses more,
        # and its last reference guess is the word
        assert played.episode.done
        if name == "wordle":
            assert played.episode.turn_rewards[-1] == 1.0 and played.episode.reward > 0.0
        else:
            assert played.episode.reward == 1.0
        assert example.tokens == played.ids and example.loss_mask == played.loss_mask()
        trained = [renderer.decode([t for t, m in zip(example.tokens[o:o + n], example.loss_mask[o:o + n],
                                                        strict=True) if m])
                   for o, n in played.model_spans]
        assert trained == [renderer.decode(renderer.encode(t)) for t in turns]  # the model's turns, no more
        assert example.n_loss_tokens == sum(n for _, n in played.model_spans) < len(example.tokens)


def test_jsonl_and_parquet_files_give_the_same_examples(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "d.jsonl", [GOOD[0], "", GOOD[1], GOOD[2]])  # a blank line is skipped
    rows = [{"messages": GOOD[0]["messages"]}, {"messages": [{"role": "user", "content": "count to 3"},
                                                            {"role": "assistant", "content": "1 2 3"}]},
            {"messages": GOOD[2]["prompt"] + GOOD[2]["completion"]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    loaded = _tiny()
    sets = []
    for name in ("d.jsonl", "d.parquet"):
        cfg = SFTConfig.model_validate({"data": {"type": "file", "path": str(tmp_path / name)}})
        sets.append(build_dataset(cfg.data, loaded.tokenizer, loaded.eos_token_ids, 512, 0))
    assert len(sets[0]) == 3 and sets[0].fingerprint == sets[1].fingerprint
    assert loaded.tokenizer.decode([t for t, m in zip(sets[0].examples[1].tokens, sets[0].examples[1].loss_mask,
                                                        strict=True) if m]) == "1 2 3<eos>"
    assert read_conversations(tmp_path / "d.jsonl")[1].where.endswith("d.jsonl line 3")


@pytest.mark.parametrize(("lines", "match"), [
    ([GOOD[0], GOOD[1], '{"messages": [oops'], r"d\.jsonl line 3: not valid JSON"),
    ([GOOD[0], {"text": "no layout"}], r"line 2: expected `messages`, or `prompt` and `completion`"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], r"line 1: `messages` must end with an assistant"),
    ([GOOD[1], {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}],
     r"line 2: `messages\[0\].role` must be one of"),
    ([GOOD[1], GOOD[1], {"prompt": "x", "completion": 7}], r"line 3: `completion` must be a non-empty list"),
    (["[1, 2]"], r"line 1: expected a JSON object"),
    ([""], r"no examples"),
])
def test_malformed_jsonl_is_refused_naming_the_line(tmp_path: Path, lines: list[Any], match: str) -> None:
    _write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(SFTDataError, match=match):
        read_conversations(tmp_path / "d.jsonl")


def test_malformed_parquet_row_and_unreadable_files(tmp_path: Path) -> None:
    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": ""}, {"prompt": "e", "completion": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    with pytest.raises(SFTDataError, match=r"d\.parquet row 3: `completion` must be a non-empty list"):
        read_conversations(tmp_path / "d.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(SFTDataError, match="not a readable Parquet file"):
        read_conversations(tmp_path / "bad.parquet")
    with pytest.raises(SFTDataError, match="cannot tell the format"):
        read_conversations(tmp_path / "d.csv")


def test_cli_reports_a_bad_data_file_and_help_needs_no_torch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write_jsonl(tmp_path / "d.jsonl", [GOOD[0], "{broken"])
    with caplog.at_level(logging.ERROR):
        rc = main(["sft", "--model.type", "tiny", "--data.type", "file", "--data.path", str(tmp_path / "d.jsonl"),
                   "--checkpoint.dir", str(tmp_path / "ck"), "--no-progress"])
    assert rc == 2
    assert "SFTDataError" in caplog.text and "d.jsonl line 2" in caplog.text
    # An environment that cannot state its answers is refused the same way.
    rc = main(["sft", "--model.type", "tiny", "--data.type", "environment", "--data.env", "reverse-text+length-max",
               "--checkpoint.dir", str(tmp_path / "ck2"), "--no-progress"])
    assert rc == 2 and "cannot state a reference completion" in caplog.text
    for command, flag in (("sft", "--batch.examples-per-step"), ("eval", "--num-tasks")):
        code = ("import sys, contextlib, io\nfrom trainer.cli import main\nout = io.StringIO()\n"
                f"with contextlib.redirect_stdout(out):\n    try: main(['{command}', '--help'])\n"
                "    except SystemExit: pass\n"
                f"assert 'torch' not in sys.modules, 'torch imported'\nassert '{flag}' in out.getvalue()\n")
        subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_shipped_recipe_hands_sft_output_to_rl() -> None:
    sft = load_sft_config(["--config", str(ROOT / "configs/trainer/reverse-text-smollm2-sft.toml")])
    rl = load_config(["--config", str(ROOT / "configs/trainer/reverse-text-smollm2-sft-rl.toml")])
    assert rl.model.type == "hf" and sft.output_dir is not None
    # RL starts from a checkpoint the SFT run keeps (step-80 of 120, see the configs' comments), not its output
    start = Path(rl.model.name_or_path)
    assert start.parent == sft.checkpoint.dir and start.name.startswith("step-")
    step = int(start.name.removeprefix("step-"))
    assert 0 < step < sft.max_steps and step % sft.checkpoint.interval == 0
    assert (sft.max_steps - step) // sft.checkpoint.interval < sft.checkpoint.keep, "the SFT run rotates it away"
    # SFT seeds below the evaluation range; RL seeds are hashed (see the configs' comments).
    assert sft.data.type == "environment" and sft.data.seed_start + sft.data.num_examples <= 1_000_000


def test_shipped_multi_turn_warm_up_parses_with_disjoint_seeds() -> None:
    """The calc-arith warm-up recipe (issue 36 item 7): reference episodes of the multi-turn environment, evaluated
    on held-out seeds (the config's own check refuses an overlap)."""
    sft = load_sft_config(["--config", str(ROOT / "configs/trainer/calc-arith-smollm2-sft.toml")])
    assert sft.data.type == "environment" and sft.data.env == "calc-arith" and sft.eval.every > 0
    assert isinstance(environments.get(sft.data.env), environments.MultiTurnEnvironment)
    assert sft.data.seed_start + sft.data.num_examples <= sft.eval.seed_start


def test_shipped_multi_turn_rl_starts_from_the_warm_ups_second_step() -> None:
    """The calc-arith GRPO recipe starts from the checkpoint `prime-trainer sft --config <warm-up> --max-steps 2
    --checkpoint.interval 2` writes (the configs' comments say why), on the same environment and held-out tasks."""
    sft = load_sft_config(["--config", str(ROOT / "configs/trainer/calc-arith-smollm2-sft.toml"),
                           "--max-steps", "2", "--checkpoint.interval", "2"])
    rl = load_config(["--config", str(ROOT / "configs/trainer/calc-arith-smollm2-sft-rl.toml")])
    start = Path(rl.model.name_or_path)
    assert rl.model.type == "hf" and start.parent == sft.checkpoint.dir and start.name == f"step-{sft.max_steps}"
    assert rl.data.type == "local" and rl.data.env == sft.data.env
    assert (rl.eval.seed_start, rl.eval.num_tasks, rl.eval.temperatures) == (
        sft.eval.seed_start, sft.eval.num_tasks, sft.eval.temperatures)
