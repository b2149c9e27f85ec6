"""The README is a front door that tells the truth: short, every link resolves, every command and
example it shows works; the settings page is the one generated from the settings classes."""

import re
from pathlib import Path

from deploy.settings_doc import documented_table, settings_page, table

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 400


def test_settings_page_is_current():
    assert documented_table(settings_page().read_text()) == table().strip(), (
        "run: python -m deploy.settings_doc --write"
    )


def test_the_readme_is_a_front_door():
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a markdown page's headings."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return out


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [m for m in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", m)]


def test_every_link_in_the_docs_resolves():
    pages = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for link in _links(page):
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = set(), [README]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        for link in _links(page):
            target = (page.parent / link.partition("#")[0]).resolve()
            if target.suffix == ".md" and target.exists():
                todo.append(target)
    orphans = [p.relative_to(ROOT) for p in (ROOT / "docs").rglob("*.md") if p.resolve() not in seen]
    assert not orphans, f"docs pages no link leads to: {orphans}"


def test_every_setting_says_what_it_does():
    missing = [line for line in table().splitlines()[2:] if line.rstrip().endswith("|  |")]
    assert not missing, "settings without a description:\n" + "\n".join(missing)


def test_every_sie_command_is_in_the_readme():
    import argparse

    from deploy.cli import build_parser

    text = README.read_text()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [name for name in sub.choices if f"sie {name}" not in text]
    assert not missing, f"sie commands the README does not mention: {missing}"
    assert "sie --version" in text


def test_make_up_passes_sie_args_as_the_readme_says():
    import re
    import subprocess

    text = README.read_text()
    example = re.search(r'make up SIE_ARGS="([^"]+)"', text)
    assert example, "the README shows how to pass options through make"
    out = subprocess.run(
        ["make", "-n", "up", f"SIE_ARGS={example.group(1)}"],
        cwd=README.parent,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert f".venv/bin/sie up {example.group(1)}" in out.stdout.splitlines()


def test_the_python_example_says_which_python():
    text = README.read_text()
    before = text[: text.index("```python\nfrom sdk import SIEClient")]
    assert "`.venv/bin/python`" in before[-400:]


def test_integration_extras_are_installable_as_said():
    import re
    import subprocess
    import sys
    import tomllib

    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = set(re.findall(r"-e '\.\[([a-z-]+)\]'", README.read_text()))
    assert {"langchain", "llamaindex"} <= named and named <= set(extras)
    for module, blocked, extra in [
        ("langchain", "langchain_core", "langchain"),
        ("llamaindex", "llama_index", "llamaindex"),
    ]:
        code = f"import sys; sys.modules[{blocked!r}] = None\nimport sdk.integrations.{module}"
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=README.parent, capture_output=True, text=True, timeout=60
        )
        hint = out.stderr.strip().splitlines()[-1]
        requirement = extras[extra][0].split(">")[0]  # e.g. langchain-core
        assert f"pip install {requirement} " in hint and f"-e '.[{extra}]'" in hint, hint
