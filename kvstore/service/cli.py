"""The ``kvstore serve`` flags and their handler (also runnable as ``python -m kvstore.service``).

    kvstore serve [-v] [--config FILE] [--address HOST:PORT|unix:PATH] [--http-address HOST:PORT|off]
                  [--data-address HOST:PORT|auto|off] [--data-dir DIR]
                  [--host-capacity SIZE] [--disk-capacity SIZE] [--staging-capacity SIZE]
                  [--token-file FILE] [--tls-cert PEM --tls-key PEM] [--allow-plaintext]
                  [--protect-metrics] [--durable-puts] [--shutdown-grace-s S] [--check-integrity-on-exit]

Flags override ``KVSTORE_*`` variables (kvstore.config, kvstore.service.config), which override
a ``--config`` TOML file (kvstore.service.config_file), which overrides the embedded defaults: gRPC on 127.0.0.1:50551, HTTP (metrics, dashboard) on 127.0.0.1:50552, the
native data plane for cross-host gets on the gRPC host and a free port (advertised by GetSlots), the
disk tier under ~/.local/share/kvstore/disk, auto sizes (a quarter of available memory for the
host tier, half the free disk for the disk tier). Prints ``kvstore serve: listening on ADDRESS``
once it accepts calls, then ``kvstore serve: dashboard on URL`` (unless HTTP is off).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from kvstore.config import StoreConfig, default_data_dir, disk_size, host_size, read_as
from kvstore.errors import KVStoreError, describe_os_error
from kvstore.service.config import DEFAULT_ADDRESS, ServeConfig, staging_size
from kvstore.service.config_file import layered_environment


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=os.environ.get("KVSTORE_CONFIG"),
                        help="TOML file of settings (keys: the KVSTORE_* names in lower case, plus data_dir); "
                             "variables and flags override it (env KVSTORE_CONFIG)")
    parser.add_argument("--address", help=f"HOST:PORT (port 0: any free one) or unix:PATH (default {DEFAULT_ADDRESS})")
    parser.add_argument("--data-dir", help=f"the disk tier lives in DIR/disk (default {default_data_dir()})")
    parser.add_argument("--host-capacity", help="host tier size, e.g. 8GiB; 0 disables it (default: auto)")
    parser.add_argument("--disk-capacity", help="disk tier size, e.g. 200GiB; 0 disables it (default: auto)")
    parser.add_argument("--http-address", help="HOST:PORT for /metrics, /healthz and the dashboard, or 'off' "
                        "(default 127.0.0.1:50552)")
    parser.add_argument("--data-address", help="HOST:PORT of the native data plane that streams host-tier "
                        "blocks to clients on other hosts, 'auto' (the --address host, any free port) or 'off' "
                        "(default auto)")
    parser.add_argument("--staging-capacity", help="shared-memory staging for same-host puts, e.g. 256MiB; 0 "
                        "disables it (default auto: 256MiB, at most half the room the host tier left in the "
                        "shared-memory directory)")
    parser.add_argument("--token-file", help="file whose first line is the bearer token clients must send "
                        "(or set KVSTORE_TOKEN); required beyond loopback")
    parser.add_argument("--tls-cert", help="PEM certificate chain: serve gRPC and HTTP over TLS")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--allow-plaintext", action="store_const", const=True,
                        help="serve gRPC, the data plane and HTTP beyond loopback without TLS "
                             "(inside a trusted network namespace only)")
    parser.add_argument("--protect-metrics", action="store_const", const=True,
                        help="/metrics needs the bearer token too")
    parser.add_argument("--durable-puts", action="store_const", const=True,
                        help="answer a put only once it is fsynced to the disk tier")
    parser.add_argument("--shutdown-grace-s", type=float, help="seconds in-flight calls get after SIGTERM, finite and "
                        "0 or more (default 10)")
    parser.add_argument("--check-integrity-on-exit", action="store_const", const=True,
                        help="after a graceful shutdown, check that every tier's books agree with the store's "
                        "(exit status 3 if not); for staging and load tests")
    parser.set_defaults(func=cmd_serve)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``kvstore`` command's subparsers."""
    parser = subparsers.add_parser("serve", help="gRPC sidecar over one store (host and disk tiers)")
    add_serve_arguments(parser)
    return parser


def store_config(args: argparse.Namespace, environ=None) -> StoreConfig:
    """``StoreConfig.from_env`` with the tier flags applied on top. A capacity of 0, from a flag, a
    variable or the config file, disables a tier; a flag's capacity enables one again."""
    host, disk = {}, {}
    if args.data_dir:
        disk["path"] = os.path.join(args.data_dir, "disk")
    if args.host_capacity is not None:
        host["capacity_bytes"] = read_as("--host-capacity", args.host_capacity, host_size)
    if args.disk_capacity is not None:
        disk["capacity_bytes"] = read_as("--disk-capacity", args.disk_capacity, disk_size)
    return StoreConfig.from_env(environ, host_settings=host, disk_settings=disk)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvstore.service.server import IntegrityCheckFailed, serve  # grpc loads only for this command

    environ = layered_environment(args.config)
    staging = None if args.staging_capacity is None else read_as("--staging-capacity", args.staging_capacity,
                                                                 staging_size)
    config = ServeConfig.from_env(environ, address=args.address, http_address=args.http_address,
                                  data_address=args.data_address, token_file=args.token_file,
                                  tls_cert=args.tls_cert, tls_key=args.tls_key, allow_plaintext=args.allow_plaintext,
                                  protect_metrics=args.protect_metrics, durable_puts=args.durable_puts,
                                  staging_bytes=staging, shutdown_grace_s=args.shutdown_grace_s,
                                  check_integrity_on_exit=args.check_integrity_on_exit)
    try:
        asyncio.run(serve(config, store_config(args, environ), _announce, _announce_http))
    except IntegrityCheckFailed as exc:
        print(f"kvstore serve: {exc}", file=sys.stderr, flush=True)
        return 3
    if config.check_integrity_on_exit:
        print("kvstore serve: integrity check passed", flush=True)
    return 0


def _announce(address: str) -> None:
    print(f"kvstore serve: listening on {address}", flush=True)


def _announce_http(url: str) -> None:
    print(f"kvstore serve: dashboard on {url}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore serve", description="gRPC sidecar over one KV-cache store.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KVStoreError as exc:
        print(f"kvstore serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a data or shared-memory directory that is missing or may not be written
        print(f"kvstore serve: {describe_os_error(exc)}", file=sys.stderr)
        return 2
