"""The table of settings in ``docs/settings.md``, generated from each process's settings class.

``python -m deploy.settings_doc`` prints the markdown table and ``--write`` puts it into
``docs/settings.md``; a test checks that the page holds exactly this table, so a new setting
cannot go undocumented.
"""

from __future__ import annotations

import ast
import inspect
import io
import sys
import textwrap
import tokenize
from pathlib import Path

from pydantic import AliasChoices
from pydantic_settings import BaseSettings

PROCESSES = [
    ("worker", "worker.settings", "WorkerSettings"),
    ("gateway", "gateway.settings", "GatewaySettings"),
    ("sidecar", "sidecar.settings", "SidecarSettings"),
    ("config service", "config_service.settings", "ConfigServiceSettings"),
]


def _comments(cls: type) -> dict[str, str]:
    """Field name → the comment on its assignment (on any of its lines, so a formatter may wrap it)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, BaseSettings)) or klass is BaseSettings:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        by_line = {
            tok.start[0]: tok.string.lstrip("#").strip()
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT
        }
        node = ast.parse(source).body[0]
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                for line in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1):
                    if line in by_line:
                        out[stmt.target.id] = by_line[line]
                        break
    return out


def env_names(cls: type[BaseSettings]) -> dict[str, str]:
    """Field name → the environment variable(s) it is read from."""
    prefix = cls.model_config.get("env_prefix", "")
    out = {}
    for name, field in cls.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            out[name] = " / ".join(str(c) for c in alias.choices)
        elif isinstance(alias, str):
            out[name] = alias
        else:
            out[name] = f"{prefix}{name}".upper()
    return out


def _default(field) -> str:
    if field.default_factory is not None:
        return "(computed)"
    value = field.default
    if value is None or value == "":
        return "—"
    repo = str(Path(__file__).resolve().parents[1])
    if isinstance(value, str) and value.startswith(repo):
        value = "<install>" + value[len(repo) :]
    return f"`{value}`"


def rows() -> list[tuple[str, str, str, str]]:
    import importlib

    seen: dict[str, tuple[str, str, str, str]] = {}
    for proc, module, cls_name in PROCESSES:
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError):
            continue
        comments = _comments(cls)
        for name, env in env_names(cls).items():
            field = cls.model_fields[name]
            desc = field.description or comments.get(name, "")
            if env in seen:
                prev = seen[env]
                seen[env] = (prev[0], prev[1] + ", " + proc, prev[2], prev[3] or desc)
            else:
                seen[env] = (env, proc, _default(field), desc)
    return sorted(seen.values())


def table() -> str:
    lines = ["| setting | read by | default | meaning |", "|---|---|---|---|"]
    for env, procs, default, desc in rows():
        lines.append(f"| `{env}` | {procs} | {default} | {desc.replace('|', '/')} |")
    return "\n".join(lines)


START, END = "<!-- settings:start -->", "<!-- settings:end -->"


def settings_page() -> Path:
    return Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def documented_table(text: str) -> str:
    """The table between the page's markers."""
    return text[text.index(START) + len(START) : text.index(END)].strip()


def write(page: Path) -> None:
    text = page.read_text()
    start, end = text.index(START) + len(START), text.index(END)
    page.write_text(text[:start] + "\n" + table() + "\n" + text[end:])


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write(settings_page())
    else:
        sys.stdout.write(table() + "\n")
