"""The README stays short and starts with the two commands; the docs' links resolve; the spec examples have one
source, examples/*.yaml, which the README, the docs, the API's example and the tests all read; what the README shows
is what the code does. In-process and cheap: CI builds the site itself (`mkdocs build --strict` in .ci/run), so
nothing here runs mkdocs."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import yaml

from sltune.tuning.cost.prior import predict
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.space import Candidate
from tests.support.offload_specs import GiB

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))

RUN = ("python3 -m venv .venv && . .venv/bin/activate && bash scripts/install.sh && "
       "sltune tune examples/tiny-llama-cpu.yaml --out best.yaml && sltune train --config best.yaml --steps 20")
TEST = "python3 -m venv .venv && . .venv/bin/activate && bash scripts/install.sh test && python -m pytest -q"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.M)


def code_blocks(text: str, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(text) if kind == lang]


def test_the_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert [(kind, body.strip()) for kind, body in FENCE.findall(text)[:2]] == [("bash", RUN), ("bash", TEST)]
    assert text.index(RUN) < 1000 and text.index(TEST) < 3000            # at the top, not further down


def test_getting_started_gives_the_readme_commands_word_for_word():
    assert code_blocks((DOCS / "getting-started.md").read_text(), "bash")[:2] == [RUN + "\n", TEST + "\n"]


def test_every_relative_link_in_the_readme_and_the_docs_resolves_to_a_file():
    broken = []
    for page in [README, *PAGES]:
        prose = FENCE.sub("", page.read_text())
        for target in LINK.findall(prose):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue                                                 # a URL, or an anchor on the same page
            if not (page.parent / target.split("#", 1)[0]).resolve().is_file():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken


def test_the_readme_spec_is_the_example_file_and_the_docs_include_it_rather_than_copy_it():
    example = (ROOT / "examples" / "tiny-llama-cpu.yaml").read_text()
    assert code_blocks(README.read_text(), "yaml") == [example]
    included = set()
    for page in PAGES:
        for block in code_blocks(page.read_text(), "yaml"):
            # a spec in the docs is an include of examples/*.yaml, never a copy that can drift
            assert "search:" not in block, f"{page.relative_to(ROOT)} copies a spec: include it with --8<--"
        for path in SNIPPET.findall(page.read_text()):
            assert (ROOT / path).is_file(), f"{page.relative_to(ROOT)} includes {path}, which does not exist"
            included.add(path)
    assert {"examples/tiny-llama-cpu.yaml", "examples/own-model.yaml"} <= included


def test_the_reference_pages_are_committed_as_the_code_generates_them():
    """They read on GitHub as they are (an error message sends users to spec.md), and cannot drift: a flag, field or
    setting changed without `python docs/hooks/reference.py` fails here, naming the command."""
    spec = importlib.util.spec_from_file_location("reference_hook", DOCS / "hooks" / "reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    markers = {m for page in PAGES for m in hook.MARKER.findall(page.read_text())}
    assert markers == set(hook.RENDERERS)                                # every renderer has its page, and back
    assert not hook.stale(), f"{hook.stale()} drifted from the code: run `python docs/hooks/reference.py`"
    page = (DOCS / "reference" / "spec.md").read_text()
    assert "| `num_live_blocks` |" in page and hook.generated(page.replace("num_live_blocks", "k", 1)) == page

    from sltune.cli.main import subcommands, parser
    from sltune.settings import Settings

    cli = (DOCS / "reference" / "cli.md").read_text()
    assert all(f"## sltune {name}\n" in cli for name in subcommands(parser()).choices)
    assert "`--sub-batch-size`" in cli
    settings = (DOCS / "reference" / "settings.md").read_text()
    assert all(f"`SLTUNE_{name.upper()}`" in settings for name in Settings.model_fields)
    assert "| `tokens_per_s` |" in (DOCS / "reference" / "trial-result.md").read_text()


def test_no_page_cites_an_issue():
    """A page says what is, not which issue brought it or what comes next."""
    cites = re.compile(r"\b[Ii]ssue #?\d+|#\d+'s\b|next steps")
    found = [f"{page.relative_to(ROOT)}: {m.group(0)}" for page in [README, *PAGES]
             for m in cites.finditer(page.read_text())]
    assert not found


def test_every_docs_page_is_in_the_nav_and_ci_builds_the_site_before_the_tests():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from pages(value) if isinstance(value, list) else [value]

    assert sorted(pages(config["nav"])) == sorted(str(p.relative_to(DOCS)) for p in PAGES)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "mkdocs build --strict" in ci
    assert ci.index("mkdocs build --strict") < ci.index("python -m pytest -q")


def test_ci_installs_what_the_readme_s_test_command_installs():
    """CI ran the DeepSpeed tests and a new user's "Test it" did not: both install with the same command now, and the
    script puts the test tools, the docs build, Ray and DeepSpeed's CPU ops in it."""
    install = "bash scripts/install.sh test"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.startswith("#")]
    assert f" && {install} && " in TEST and install in ci
    assert not any(line.startswith(("pip ", "python -m pip")) or " pip install" in line for line in ci)
    script = (ROOT / "scripts" / "install.sh").read_text()
    assert 'test) extras="[test,docs,ray]" ; backends=1 ;;' in script and "DS_BUILD_CPU_ADAM=1" in script


def test_the_readme_first_command_trains_from_best_yaml_alone():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    first = readme.split("```bash\n", 1)[1].split("```", 1)[0].strip()
    assert first.endswith("sltune tune examples/tiny-llama-cpu.yaml --out best.yaml && "
                          "sltune train --config best.yaml --steps 20")


def test_the_readme_table_is_what_plan_predicts():
    """The README's 7B/13B/70B rows are the prior's figures, not typed in: a change to the prior shows here."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    places = [Candidate(1, 4, 1), Candidate(1, 4, 1, optimizer_offload="disk"),
              Candidate(1, 4, 1, optimizer_offload="disk", param_offload="disk")]
    for model, name in [("llama-2-7b", "Llama-2-7B"), ("llama-2-13b", "Llama-2-13B"), ("llama-2-70b", "Llama-2-70B")]:
        recipe = Setup(model, shape_of(model, "bfloat16"), seq_len=2048, device="cuda")
        host, optimizer, weights = (predict(recipe, c) for c in places)
        once = dataclasses.replace(recipe, disk_versions=1)
        optimizer1, weights1 = (predict(once, c) for c in places[1:])
        row = (f"| {name} | {host.host / GiB:.1f} GiB | {optimizer.host / GiB:.1f} GiB | "
               f"{weights.host / GiB:.1f} GiB | "
               f"{optimizer.disk / GiB:.0f} / {weights.disk / GiB:.0f} GiB | "
               f"{optimizer1.disk / GiB:.0f} / {weights1.disk / GiB:.0f} GiB | {weights.device / GiB:.1f} GiB |")
        assert row in readme, row
