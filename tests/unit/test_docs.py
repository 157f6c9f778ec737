"""The README stays short and starts with the two commands; the docs' links resolve; the spec examples have one
source, examples/*.yaml, which the README, the docs, the API's example and the tests all read. In-process and cheap:
CI builds the site itself (`mkdocs build --strict` in .ci/run), so nothing here runs mkdocs."""

import importlib.util
import re
import tomllib
from pathlib import Path

import yaml

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
    # that the server accepts it as it is: tests/integration/test_dashboard_pages.py posts the API's example


def test_the_openapi_example_is_the_example_file_in_a_checkout_and_in_a_wheel():
    from sltune.api import examples

    source = ROOT / "examples" / "tiny-llama-cpu.yaml"
    assert examples.SOURCE == source and examples.TUNE_EXAMPLE == yaml.safe_load(source.read_text())
    # a wheel (the Docker image) has no examples/ folder: it reads the packaged copy, held equal byte for byte
    assert examples.PACKAGED.read_bytes() == source.read_bytes()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(examples.PACKAGED.match(pattern) for pattern in package_data["sltune.api"])


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
    script puts the test tools, the docs build and DeepSpeed's CPU ops in it."""
    install = "bash scripts/install.sh test"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.startswith("#")]
    assert f" && {install} && " in TEST and install in ci
    assert not any(line.startswith(("pip ", "python -m pip")) or " pip install" in line for line in ci)
    script = (ROOT / "scripts" / "install.sh").read_text()
    assert 'test) extras="[test,docs]" ; backends=1 ;;' in script and "DS_BUILD_CPU_ADAM=1" in script
