"""The ``sie`` command. Each subcommand imports only the process it starts."""

from __future__ import annotations

import argparse
import os
import signal
import sys


def _serve(args: argparse.Namespace) -> int:
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
            "api_key": args.api_key,
        }.items()
        if v is not None
    }
    settings = WorkerSettings(**overrides)
    from deploy.state import port_in_use

    if settings.process_index == 0 and port_in_use(settings.port, settings.host):
        print(
            f"sie serve: port {settings.port} is in use on {settings.host} (another sie serve or sie up?); "
            "pick another with --port",
            file=sys.stderr,
        )
        return 1
    from worker.serve.main import main as serve_main

    serve_main(settings)
    return 0


def _up(args: argparse.Namespace) -> int:
    from deploy.launcher import default_gateways, default_model_processes, default_workers, up

    if args.workers is None:
        args.workers = default_workers(dict(os.environ))
    if args.model_processes is None:
        args.model_processes = default_model_processes(dict(os.environ))
    if args.gateways is None:
        args.gateways = default_gateways(dict(os.environ))
    if args.nats_replicas not in (1, 3, 5):
        print(
            "sie up: --nats-replicas must be 1, 3 or 5 (a JetStream cluster needs a majority)",
            file=sys.stderr,
        )
        return 2
    for flag, value in (
        ("--gateways", args.gateways),
        ("--workers", args.workers),
        ("--model-processes", args.model_processes),
        ("--config-replicas", args.config_replicas),
    ):
        if value < 1:
            print(f"sie up: {flag} needs at least 1", file=sys.stderr)
            return 2
    metrics_port = args.metrics_port if args.metrics_port is not None else (9095 if args.observe else 0)
    return up(
        args.state_dir,
        args.port or 8080,
        args.config_port,
        args.nats_port,
        args.preload,
        args.detach,
        args.gateways,
        observe=args.observe,
        otlp_port=args.otlp_port,
        metrics_port=metrics_port,
        workers=args.workers,
        model_processes=args.model_processes,
        nats_replicas=args.nats_replicas,
        config_replicas=args.config_replicas,
        config_db=args.config_db or "",
        worker_cpus=args.worker_cpus,
    )


def _status(args: argparse.Namespace) -> int:
    from deploy.state import NoCluster, find_state_dir
    from deploy.supervisor import status

    try:
        return status(find_state_dir(args.state_dir))
    except NoCluster as exc:
        print(f"sie: {exc}", file=sys.stderr)
        return 1


def _down(args: argparse.Namespace) -> int:
    from deploy.commands import down

    return down(args.state_dir)


def _logs(args: argparse.Namespace) -> int:
    from deploy.commands import logs

    return logs(args.state_dir, args.process, args.follow)


def _models_add(args: argparse.Namespace) -> int:
    from deploy.commands import add_model

    return add_model(args.file, args.url, args.token, args.state_dir)


def _batch(args: argparse.Namespace) -> int:
    from deploy import batch_cli

    if args.batch_command == "submit":
        return batch_cli.submit(
            args.file, args.model, args.endpoint, args.url, args.token, args.state_dir, args.output
        )
    return batch_cli.status(
        args.batch_id, args.url, args.token, args.state_dir, cancel=args.batch_command == "cancel"
    )


def _version() -> str:
    from protocol import SERVER_VERSION

    return SERVER_VERSION


def _models_other(args: argparse.Namespace) -> int:
    from deploy import commands

    if args.models_command == "list":
        return commands.list_models(args.url, args.token, args.state_dir)
    if args.models_command == "show":
        return commands.show_model(args.model_id, args.url, args.token, args.state_dir)
    return commands.delete_model(args.model_id, args.url, args.token, args.state_dir)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="bind address (SIE_HOST, default 0.0.0.0)")
    p.add_argument("--port", type=int, help="port (SIE_PORT, default 8080)")
    p.add_argument("--preload", help="comma-separated models to load at start (SIE_PRELOAD_MODELS)")
    p.add_argument("--models-dir", help="directory of model YAML files (SIE_MODELS_DIR)")
    p.add_argument("--bundles-dir", help="directory of bundle YAML files (SIE_BUNDLES_DIR)")
    p.add_argument("--device", help="auto | cpu | cuda (SIE_DEVICE)")
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help="require Authorization: Bearer KEY on every route but the probes (/healthz, /livez, "
        "/readyz) and /openapi.json, /docs; several keys comma-separated; 401 without one "
        "(SIE_API_KEY; prefer the variable, a flag shows in ps; default: open; "
        "SIE_AUTH_EXEMPT_OPERATIONAL=true also opens /, /health, /metrics, /ws/status)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sie", description="sie-cluster: inference for small AI models")
    parser.add_argument("--version", action="version", version=f"sie-cluster {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the standalone worker (HTTP API + batching + models)")
    _add_serve_args(serve)
    serve.set_defaults(func=_serve)
    up = sub.add_parser(
        "up", help="run the whole cluster locally (nats, config service, gateway, worker pods)"
    )
    up.add_argument("--port", type=int, help="gateway port (default 8080)")
    up.add_argument("--config-port", type=int, default=8090, help="config service port (default 8090)")
    up.add_argument("--nats-port", type=int, default=4250, help="nats-server port (default 4250)")
    up.add_argument(
        "--nats-replicas",
        type=int,
        default=1,
        help="NATS members: 1, or 3 (a JetStream cluster on the ports after --nats-port: clients, "
        "routes, monitoring; streams and buckets replicated 3 times) (default 1)",
    )
    up.add_argument(
        "--config-replicas",
        type=int,
        default=1,
        help="config service replicas on --config-port and the ports after it: one writer, the "
        "others standbys that forward writes and take over when it dies (default 1)",
    )
    up.add_argument(
        "--config-db",
        help="SQLAlchemy URL of the config store, e.g. postgresql://user@127.0.0.1:5432/sie "
        "(default: SQLite under the state directory)",
    )
    up.add_argument("--preload", help="comma-separated models the worker loads at start")
    up.add_argument("--state-dir", default=".sie-state", help="JetStream, SQLite, logs, tokens (0600)")
    up.add_argument("--detach", action="store_true", help="run in the background; `sie down` stops it")
    up.add_argument(
        "--gateways",
        type=int,
        help="gateway replicas sharing the port (SO_REUSEPORT), as a Service spreads them "
        "(default: 2 on a GPU host, where one gateway's CPU limits short requests; else 1)",
    )
    up.add_argument(
        "--workers",
        type=int,
        help="worker pods (a worker and its sidecar each) sharing the lane, as the chart's "
        "replicas do; on a GPU host each gets the next GPU (default: one per GPU, as the chart "
        "deploys them; else 1)",
    )
    up.add_argument(
        "--model-processes",
        type=int,
        help="model processes in each worker pod, each a whole worker on the pod's device with a "
        "sidecar of its own, as in the chart's pods (default: SIE_MODEL_PROCESSES, else 4 on a GPU "
        "host, where one Python process cannot keep the GPU fed; else 1)",
    )
    up.add_argument(
        "--worker-cpus",
        type=int,
        default=0,
        help="CPUs of their own for the worker processes (the last N; their torch threads shared "
        "among them), every other process on the rest, as the kubelet's static CPU manager gives a "
        "Guaranteed worker pod whole cores; keeps other processes out of the forwards (default 0: "
        "all share every CPU)",
    )
    up.add_argument(
        "--observe",
        action="store_true",
        help="trace every request: an OTLP receiver here prints the spans of each hop; "
        "also serves the worker pod's metrics (needs the observe extra)",
    )
    up.add_argument(
        "--otlp-port", type=int, default=4318, help="port of the --observe OTLP receiver (default 4318)"
    )
    up.add_argument(
        "--metrics-port",
        type=int,
        help="worker pod metrics port, sidecar + worker (default 9095 with --observe, else off)",
    )
    up.set_defaults(func=_up)
    found = "default: ./.sie-state, else the last `sie up`'s"
    st = sub.add_parser("status", help="the processes of a running `sie up`, their restarts and logs")
    st.add_argument("--state-dir", help=f"the state directory `sie up` was given ({found})")
    st.set_defaults(func=_status)
    dn = sub.add_parser("down", help="stop a running `sie up` (the gateway first, NATS last)")
    dn.add_argument("--state-dir", help=f"the state directory `sie up` was given ({found})")
    dn.set_defaults(func=_down)
    lg = sub.add_parser("logs", help="the logs of a `sie up`'s processes")
    lg.add_argument("process", nargs="?", help="nats | config | worker | sidecar | gateway (default: all)")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing what is appended")
    lg.add_argument("--state-dir", help=f"the state directory `sie up` was given ({found})")
    lg.set_defaults(func=_logs)
    models = sub.add_parser("models", help="manage model configs in the config service")
    msub = models.add_subparsers(dest="models_command", required=True)
    add = msub.add_parser("add", help="add a model (or profiles) from a YAML file")
    add.add_argument("file")
    add.add_argument("--url", help="config service URL (default: the running sie up's)")
    add.add_argument("--token", help="admin token (default: SIE_ADMIN_TOKEN, else the running sie up's)")
    add.add_argument("--state-dir", help=f"the state directory `sie up` was given ({found})")
    add.set_defaults(func=_models_add)
    for name, what in (("list", "list the configured models"), ("show", "print one model's stored YAML"),
                       ("delete", "delete a model's API config (workers unload it; the gateway stops routing it)")):  # fmt: skip
        cmd = msub.add_parser(name, help=what)
        if name != "list":
            cmd.add_argument("model_id")
        cmd.add_argument("--url", help="config service URL (default: the running sie up's)")
        cmd.add_argument("--token", help="admin token (default: SIE_ADMIN_TOKEN, else the running sie up's)")
        cmd.add_argument("--state-dir", help=f"the state directory `sie up` was given ({found})")
        cmd.set_defaults(func=_models_other)
    batch = sub.add_parser("batch", help="run a file of texts through the cluster's Batch API")
    bsub = batch.add_subparsers(dest="batch_command", required=True)
    submit = bsub.add_parser(
        "submit",
        help="submit FILE (texts, one per line, or OpenAI batch request lines), follow it, write the output",
    )
    submit.add_argument("file")
    submit.add_argument("--model", help="the model each text is encoded with (needed for a file of texts)")
    submit.add_argument(
        "--endpoint",
        default="/v1/embeddings",
        choices=["/v1/embeddings", "/v1/encode"],
        help="the API of each line",
    )
    submit.add_argument(
        "-o", "--output", help="where the output file goes (default: FILE's name + .out.jsonl)"
    )
    for name, what in (("status", "print a batch and its progress"), ("cancel", "cancel a batch")):
        cmd = bsub.add_parser(name, help=what)
        cmd.add_argument("batch_id")
    for cmd in (submit, *(bsub.choices[n] for n in ("status", "cancel"))):
        cmd.add_argument("--url", help="gateway URL (default: SIE_URL, else the running sie up's)")
        cmd.add_argument("--token", help="API token (default: SIE_API_KEY)")
        cmd.add_argument("--state-dir", help=f"the state directory `sie up` was given ({found})")
        cmd.set_defaults(func=_batch)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # inside the try: a reader gone early shows here, not at exit
    except BrokenPipeError:
        # `sie logs | head`: the reader has what it wanted. Quietly, as Unix tools end there (exit
        # 128 + SIGPIPE); stdout goes to /dev/null so that the flush at exit raises nothing more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
