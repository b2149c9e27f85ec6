"""The README's settings table is the one generated from the settings classes."""

from pathlib import Path

from deploy.settings_doc import table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_settings_table_is_current():
    text = README.read_text()
    start = text.index("<!-- settings:start -->") + len("<!-- settings:start -->")
    end = text.index("<!-- settings:end -->")
    assert text[start:end].strip() == table().strip(), (
        "run: python -m deploy.settings_doc and paste into README.md"
    )


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
    start, end = text.index("<!-- settings:start -->"), text.index("<!-- settings:end -->")
    return (text[:start] + text[end:]).splitlines()


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


def test_the_readme_names_the_queue_message_limit_of_one_item():
    """The gateway refuses an item over the NATS server's max_payload less 1,024 (gateway/core.py);
    nats-server's default max_payload, as `sie up` runs it, is 1 MiB; the chart sets 8MB."""
    import re

    rows = [ln for ln in _outside_the_settings_table(README.read_text()) if ln.startswith("|")]
    (row,) = [ln for ln in rows if "max_payload" in ln and "work-queue message" in ln]
    assert f"{(1 << 20) - 1024:,} bytes" in row
    nats_conf = (README.parent / "helm/sie-cluster/templates/nats.yaml").read_text()
    chart = re.search(r"max_payload: (\d+)MB", nats_conf)
    assert chart and f"{chart.group(1)} MB less 1,024 with the Helm chart" in row


def test_the_readme_says_what_the_weights_field_tells():
    """Issue 36: GET /v1/models and `sie models list` say where each model's weights are."""
    from protocol.weights import STATUSES

    paragraphs = [
        p
        for p in README.read_text().split("\n\n")
        if "/v1/models" in p and "sie models list" in p and "weights" in p
    ]
    assert any(all(f"`{status}`" in p for status in STATUSES) for p in paragraphs), paragraphs
