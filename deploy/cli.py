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
    # Until the cluster launcher lands, the main job is the standalone server on :8080.
    return _serve(args)


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
    up = sub.add_parser("up", help="run the main job locally")
    _add_serve_args(up)
    up.set_defaults(func=_up)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
