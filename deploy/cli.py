"""The ``sie`` command. Each subcommand imports only the process it starts."""

from __future__ import annotations

import argparse
import sys


def _serve(args: argparse.Namespace) -> int:
    from worker.serve.main import main as serve_main
    from worker.settings import WorkerSettings

    overrides = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "preload_models": args.preload,
            "models_dir": args.models_dir,
            "bundles_dir": args.bundles_dir,
            "device": args.device,
        }.items()
        if v is not None
    }
    serve_main(WorkerSettings(**overrides))
    return 0


def _up(args: argparse.Namespace) -> int:
    from deploy.launcher import up

    return up(args.state_dir, args.port or 8080, args.config_port, args.nats_port, args.preload)


def _status(args: argparse.Namespace) -> int:
    from pathlib import Path

    from deploy.supervisor import status

    return status(Path(args.state_dir).resolve())


def _models_add(args: argparse.Namespace) -> int:
    from deploy.launcher import add_model

    return add_model(args.file, args.url, args.token, args.state_dir)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="bind address (SIE_HOST, default 0.0.0.0)")
    p.add_argument("--port", type=int, help="port (SIE_PORT, default 8080)")
    p.add_argument("--preload", help="comma-separated models to load at start (SIE_PRELOAD_MODELS)")
    p.add_argument("--models-dir", help="directory of model YAML files (SIE_MODELS_DIR)")
    p.add_argument("--bundles-dir", help="directory of bundle YAML files (SIE_BUNDLES_DIR)")
    p.add_argument("--device", help="auto | cpu | cuda (SIE_DEVICE)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sie", description="sie-cluster: inference for small AI models")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the standalone worker (HTTP API + batching + models)")
    _add_serve_args(serve)
    serve.set_defaults(func=_serve)
    up = sub.add_parser(
        "up", help="run the whole cluster locally (nats, config service, gateway, one worker pod)"
    )
    up.add_argument("--port", type=int, help="gateway port (default 8080)")
    up.add_argument("--config-port", type=int, default=8090, help="config service port (default 8090)")
    up.add_argument("--nats-port", type=int, default=4250, help="nats-server port (default 4250)")
    up.add_argument("--preload", help="comma-separated models the worker loads at start")
    up.add_argument("--state-dir", default=".sie-state", help="JetStream, SQLite, logs, admin token")
    up.set_defaults(func=_up)
    st = sub.add_parser("status", help="the processes of a running `sie up`, their restarts and logs")
    st.add_argument("--state-dir", default=".sie-state", help="the state directory `sie up` was given")
    st.set_defaults(func=_status)
    models = sub.add_parser("models", help="manage model configs in the config service")
    msub = models.add_subparsers(dest="models_command", required=True)
    add = msub.add_parser("add", help="add a model (or profiles) from a YAML file")
    add.add_argument("file")
    add.add_argument("--url", default="http://127.0.0.1:8090", help="config service URL")
    add.add_argument("--token", help="admin token (default: SIE_ADMIN_TOKEN or the one `sie up` generated)")
    add.add_argument("--state-dir", default=".sie-state")
    add.set_defaults(func=_models_add)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
