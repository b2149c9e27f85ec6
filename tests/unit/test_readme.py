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
    assert {"langchain", "llamaindex", "haystack"} <= named and named <= set(extras)
    for module, blocked, extra in [
        ("langchain", "langchain_core", "langchain"),
        ("llamaindex", "llama_index", "llamaindex"),
        ("haystack", "haystack", "haystack"),
    ]:
        code = f"import sys; sys.modules[{blocked!r}] = None\nimport sdk.integrations.{module}"
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=README.parent, capture_output=True, text=True, timeout=60
        )
        hint = out.stderr.strip().splitlines()[-1]
        requirement = extras[extra][0].split(">")[0]  # e.g. langchain-core
        assert f"pip install {requirement} " in hint and f"-e '.[{extra}]'" in hint, hint


def test_the_public_sdk_is_installed_into_a_python_312():
    """Issue 36: every sie-sdk release needs Python 3.12+; the README says so and shows a 3.12 venv,
    the way the tests install it (tests/support/sdk312.py)."""
    import re

    from tests.support import sdk312

    text = README.read_text()
    command = re.search(r"(python3\.1[2-9]) -m venv (\S+) && \2/bin/pip install sie-sdk", text)
    assert command, "show how to install sie-sdk into a Python 3.12 venv"
    around = text[max(0, command.start() - 300) : command.end()]
    assert "3.12" in around and "sie-sdk" in around
    assert command.group(2) == sdk312.VENV.name


LIMITS = {
    "gateway.settings:GatewaySettings": [
        "gateway_max_body_bytes",
        "gateway_max_items",
        "gateway_max_score_items",
        "gateway_max_stream_pending",
        "gateway_request_timeout_s",
        "gateway_body_timeout_s",
    ],
    "worker.settings:WorkerSettings": [
        "max_request_body_bytes",
        "max_items_per_request",
        "max_score_items",
        "request_body_timeout_s",
        "max_item_text_bytes",
        "max_chunks_per_item",
    ],
    "config_service.settings:ConfigServiceSettings": ["config_max_body_bytes"],
}


def _forms(value) -> set[str]:
    """How a default may be written: 4096, 4,096, 16 MiB, 30 s."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    out = {str(value), f"{value:,}"}
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        out.add(f"{value >> 20} MiB")
    return out | {f"{f} s" for f in out}


def _outside_the_settings_table(text: str) -> list[str]:
    """The README's lines; the settings table lives in docs/settings.md, not here."""
    assert "<!-- settings:start -->" not in text
    return text.splitlines()


def test_the_readme_lists_every_request_limit_with_its_default():
    """Issue 36: each limit a request can run into is in the README's limits table, beside its
    setting, with the default the settings class has (the settings table aside)."""
    import importlib

    from deploy.settings_doc import env_names

    lines = [ln for ln in _outside_the_settings_table(README.read_text()) if ln.startswith("|")]
    wrong = []
    for where, fields in LIMITS.items():
        module, name = where.split(":")
        cls = getattr(importlib.import_module(module), name)
        envs = env_names(cls)
        for field in fields:
            env, default = envs[field], cls.model_fields[field].default
            rows = [ln for ln in lines if f"`{env}`" in ln]
            cells = [c.strip() for row in rows for c in row.split("|")]
            if not rows or not _forms(default) & set(cells):
                wrong.append(f"{env} (default {default}): {rows or 'no row'}")
    assert not wrong, "limits missing from the README, or with another default:\n" + "\n".join(wrong)


def test_the_readme_says_items_over_a_queue_message_go_through_the_payload_store():
    """An item over the NATS server's max_payload travels through the payload store (issue 34,
    iokit/payloads.py): no limit of its own; nats-server's default is 1 MiB, the chart's 8MB."""
    import re

    from protocol.streams import PAYLOADS_BUCKET as BUCKET

    rows = [ln for ln in _outside_the_settings_table(README.read_text()) if ln.startswith("|")]
    (row,) = [ln for ln in rows if "max_payload" in ln and "work-queue message" in ln]
    assert f"`{BUCKET}`" in row and "1 MiB under `sie up`" in row
    nats_conf = (README.parent / "helm/sie-cluster/templates/nats.yaml").read_text()
    chart = re.search(r"max_payload: (\d+)MB", nats_conf)
    assert chart and f"{chart.group(1)} MB with the Helm chart" in row


def test_the_readme_says_what_the_weights_field_tells():
    """Issue 36: GET /v1/models and `sie models list` say where each model's weights are."""
    from protocol.weights import STATUSES

    paragraphs = [
        p
        for p in README.read_text().split("\n\n")
        if "/v1/models" in p and "sie models list" in p and "weights" in p
    ]
    assert any(all(f"`{status}`" in p for status in STATUSES) for p in paragraphs), paragraphs
