"""The documentation cannot rot: generated reference pages match the code, and every relative link resolves.

`docs/generate.py` writes docs/reference/ from the config trees, the reason enum, the message models, the
compiled contract ABI and the validator's OpenAPI; when any of them changes without `make docs`, the
freshness test names the stale page. The link test reads every markdown page a newcomer is sent to
(the README, bench/README.md, docs/ and each package README) and checks each relative link's file and,
for `page.md#heading`, the heading.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rendered() -> tuple[ModuleType, dict[str, str], bool]:
    torch_before = "torch" in sys.modules
    generate = _generator()
    files = generate.render()
    return generate, files, torch_before


def test_generated_reference_pages_are_current(rendered: tuple[ModuleType, dict[str, str], bool]) -> None:
    generate, files, torch_before = rendered
    assert generate.stale(files) == [], "run `make docs` (PYTHONPATH=. python docs/generate.py) and commit"
    if not torch_before:  # the generator reads config trees and schemas only; it must stay cheap
        assert "torch" not in sys.modules


def test_staleness_check_names_changed_missing_and_leftover_pages(
    rendered: tuple[ModuleType, dict[str, str], bool], tmp_path: Path
) -> None:
    generate, files, _ = rendered
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert generate.stale(files, tmp_path) == []
    (tmp_path / "reasons.md").write_text(files["reasons.md"].replace("`equivocation` | hard", "`equivocation` | soft"))
    (tmp_path / "seeds.md").unlink()
    (tmp_path / "config-old-role.md").write_text("# a page no longer generated\n")
    assert generate.stale(files, tmp_path) == ["config-old-role.md", "reasons.md", "seeds.md"]


def test_reference_covers_every_reason_message_and_event(rendered: tuple[ModuleType, dict[str, str], bool]) -> None:
    """What the protocol pages promise: each reason with its class, each message kind, each ABI event."""
    import json

    from protocol.envelope import registered_bodies
    from protocol.rollout import Reason

    _, files, _ = rendered
    for reason in Reason:
        klass = "accepted" if reason is Reason.ACCEPTED else ("hard" if reason.hard else "soft")
        assert f"| {reason.code} | `{reason.value}` | {klass} |" in files["reasons.md"]
    for (kind, version), body in registered_bodies().items():
        if body.__module__.split(".")[0] == "tests" or body.__module__.startswith("test_"):
            continue  # a test's own message body (tests/unit/protocol registers some) is not the protocol's
        assert f"| `{kind}` | {version} | [{body.__name__}]" in files["messages.md"]
    abi = json.loads((ROOT / "contracts" / "artifacts" / "ComputePool.json").read_text())["abi"]
    for event in (e for e in abi if e["type"] == "event"):
        assert f"| `{event['name']}` |" in files["contract-events.md"]
    assert "`--weights.trainer` · `PRIME_WEIGHTS__TRAINER`" in files["config-node.md"]
    from devnet.config import DevnetConfig
    from node.config import NodeConfig
    from protocol.config import build_parser
    from trainer.config import TrainerConfig
    from validator.config import ValidatorConfig

    for page, config in (("config-node.md", NodeConfig), ("config-validator.md", ValidatorConfig),
                         ("config-trainer.md", TrainerConfig), ("config-devnet.md", DevnetConfig)):
        known = set(build_parser(config).root_parser._option_string_actions)
        section = files[page].split("## `prime-trainer sft`")[0]  # the trainer page's first tree is GRPO's
        shown = {flag for pair in re.findall(r"<br>`(--[a-z0-9.-]+)`(?: / `(--[a-z0-9.-]+)`)?", section)
                 for flag in pair if flag}
        assert len(shown) > 10 and shown <= known, sorted(shown - known)
    assert "| GET | `/v1/feed` |" in files["validator-api.md"]


def test_readme_layout_lists_every_top_level_folder() -> None:
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    folders = {line.split("/")[0] for line in tracked.splitlines() if "/" in line and not line.startswith(".")}
    if not folders:
        pytest.skip("not a git checkout")
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([^`/]+)/` \|", layout, re.MULTILINE))
    assert folders <= listed, f"add to the README's layout table: {sorted(folders - listed)}"


def test_house_rules_are_linked_and_the_readme_stays_short() -> None:
    assert (ROOT / "CONVENTIONS.md").is_file()
    for page in (ROOT / "README.md", ROOT / "docs" / "README.md"):
        assert "CONVENTIONS.md" in page.read_text(), f"{page.relative_to(ROOT)} should link CONVENTIONS.md"
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 160, f"README.md has {lines} lines (at most 160: details go to docs/ and the package READMEs)"


# Files that still cite a design note outside the repository while another branch rewrites them (the validator's
# split into rooms); the list may only shrink.
def test_nothing_cites_a_design_note_outside_the_repository() -> None:
    """The docs are the design of record: code and pages cite docs/architecture.md and docs/protocol/, never a
    DESIGN.md or a research note that is not in the repository."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.toml"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    outside = re.compile(r"\bDESIGN\.md\b|shared/research/")
    citing = {name for name in tracked
              if (ROOT / name).is_file() and outside.search((ROOT / name).read_text(errors="replace"))}
    citing.discard("tests/unit/docs/test_docs.py")
    assert not citing, sorted(citing)


def test_bench_readme_names_every_benchmark_program() -> None:
    """Every module of the bench package is named (`bench.<name>`), and every program with a `--smoke` shows its
    command in the `python -m bench.<name>` form."""
    text = (ROOT / "bench" / "README.md").read_text()
    modules = sorted(p for p in (ROOT / "bench").glob("*.py") if p.name != "__init__.py")
    assert modules and [p.name for p in modules if f"bench.{p.stem}" not in text and f"bench/{p.name}" not in text] == []
    programs = [p.stem for p in modules if p.stem != "harness" and "harness.parser(" in p.read_text()]  # with --smoke
    assert programs and [p for p in programs if f"`python -m bench.{p} " not in text] == []
    assert not re.search(r"python bench/[a-z_]+\.py", text), "commands run the package's modules: python -m bench.<name>"


# ---------------------------------------------------------------- links

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _pages() -> list[Path]:
    pages = [ROOT / "README.md", ROOT / "CONVENTIONS.md", ROOT / "bench" / "README.md"]
    pages += sorted((ROOT / "docs").rglob("*.md"))
    pages += sorted(p for p in ROOT.glob("*/README.md") if p.parent.name not in ("node_modules", ".venv"))
    return sorted(set(pages))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for heading in _HEADING.findall(text):
        slug = _slug(heading)
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(page: Path) -> list[str]:
    text = _CODE_SPAN.sub("", _FENCE.sub("", page.read_text()))
    return _LINK.findall(text)


def broken_links(pages: list[Path], root: Path = ROOT) -> list[str]:
    broken = []
    for page in pages:
        for target in _links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            path_part, _, fragment = target.partition("#")
            dest = page if not path_part else (page.parent / path_part).resolve()
            where = f"{page.relative_to(root)}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                broken.append(f"{where} (no heading #{fragment})")
    return broken


def test_every_relative_link_resolves() -> None:
    pages = _pages()
    assert (ROOT / "docs" / "README.md").is_file() and (ROOT / "bench" / "README.md").is_file()
    assert broken_links(pages) == []


def test_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n## Run a `node` (CPU)\n\nsee [b](b.md) and [x](#run-a-node-cpu)\n")
    (tmp_path / "b.md").write_text(
        "[gone](missing.md), [heading](a.md#run-a-node-cpu), [no heading](a.md#nope), "
        "[web](https://example.org/x.md), `[in code](nowhere.md)`\n\n```\n[in a block](nowhere.md)\n```\n")
    assert broken_links([tmp_path / "a.md", tmp_path / "b.md"], tmp_path) == [
        "b.md: missing.md (no such file)", "b.md: a.md#nope (no heading #nope)"]


# ---------------------------------------------------------------- commands shown in the guides

_ROLE_COMMANDS = ("prime-node", "prime-validator", "prime-trainer", "prime-devnet", "prime-relay", "prime-chain")


def shown_commands(page: Path) -> list[str]:
    """The `prime-*` command lines in a page's bash blocks: continuations joined, leading `VAR=value`
    assignments, trailing comments, pipes and `&` dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).split(" | ")[0].strip().rstrip("&").strip()
            line = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+", "", line)
            if line.startswith(_ROLE_COMMANDS):
                commands.append(" ".join(line.split()))
    return commands


def parse_shown(line: str) -> None:
    """Parse one shown command with its role's own parser (nothing runs); raises on an unknown flag."""
    import shlex

    # the sessions' shell variables: an address, a password variable's name, a hash
    line = line.replace("$T", "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC").replace("$PW", "pw").replace("$H", "0x" + "ab" * 32)
    words = shlex.split(line)
    program, args = words[0], words[1:]
    if program == "prime-node":
        from node.cli import expand_flags
        from node.config import load_config as node_config

        command, rest = args[0], args[1:]
        if command == "protection":
            rest = rest[2:]
        node_config(expand_flags(rest))
    elif program == "prime-validator":
        from validator.config import load_config as validator_config

        validator_config(args)
    elif program == "prime-trainer":
        from trainer.config import load_config, load_eval_config, load_sft_config

        loader = {"sft": load_sft_config, "eval": load_eval_config}.get(args[0] if args else "")
        (loader or load_config)(args[1:] if loader else args)
    elif program == "prime-devnet":
        from devnet.config import load_config as devnet_config

        if args and args[0] == "up":
            devnet_config(args[1:])
    elif program == "prime-relay":
        from shardcast.cli import _parser as relay_parser

        relay_parser().parse_args([a for a in args if a != "..."])
    elif program == "prime-chain":
        from contracts.deploy import build_parser

        build_parser().parse_args(args)


def test_every_command_shown_in_the_guides_parses() -> None:
    """A flag renamed in a config tree fails here, not in a newcomer's terminal."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs" / "operators").glob("*.md"))]
    shown = {(page, line) for page in pages for line in shown_commands(page)}
    assert len(shown) > 30
    failures = []
    for page, line in sorted(shown):
        try:
            parse_shown(line)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - argparse exits; report every page's line
            failures.append(f"{page.relative_to(ROOT)}: {line}: {type(exc).__name__}: {exc}")
    assert failures == []


def test_a_wrong_flag_in_a_shown_command_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "guide.md"
    page.write_text("```bash\nPW=x prime-node join --cpu \\\n    --keystore node.json   # a comment\n"
                    "prime-validator --chek.retries 2 &\n```\n")
    join, validator = shown_commands(page)
    assert join == "prime-node join --cpu --keystore node.json"
    parse_shown(join)
    with pytest.raises(Exception, match="chek"):
        parse_shown(validator)
