"""The ``kvstore`` command. Each subcommand parses flags and calls one function; no logic here.

    kvstore run     the main job with embedded defaults (for now: the store walkthrough)
    kvstore bench   bandwidths and lookup time next to their ceilings (--json for one object)
    kvstore fsck    verify a disk tier directory (--repair to drop bad blocks)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from typing import Callable

from kvstore.config import DiskConfig, HostConfig, StoreConfig, default_data_dir, parse_size
from kvstore.errors import InvalidRequest, KVStoreError


def progress_bars(label: str, total: int) -> Callable[[int], None]:
    """A tqdm bar on a terminal (bytes), silent elsewhere."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, disable=None, file=sys.stderr, leave=False)
    return bar.update


def _cmd_run(args: argparse.Namespace) -> int:
    from kvstore.walkthrough import run_walkthrough

    data_dir = args.data_dir or (tempfile.mkdtemp(prefix="kvstore-run-") if args.ephemeral else default_data_dir())
    config = StoreConfig.from_env()
    config.host = HostConfig(capacity_bytes=parse_size(args.host_capacity))
    config.disk = DiskConfig(path=os.path.join(data_dir, "disk"), capacity_bytes=parse_size(args.disk_capacity))
    print(f"kvstore run: store in {config.disk.path}")
    reports = run_walkthrough(config, print)
    ok = all(r.verified for r in reports)
    print("every reused block equals a cold computation" if ok else "MISMATCH: a reused block differs")
    return 0 if ok else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvstore.bench import BenchConfig, format_table, run_bench

    if min(args.blocks, args.repeats, args.lookup_tokens) <= 0:
        raise InvalidRequest("--blocks, --repeats and --lookup-tokens must be positive")
    cfg = BenchConfig(blocks=args.blocks, repeats=args.repeats, lookup_tokens=args.lookup_tokens, directory=args.dir)
    log = (lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr))
    result = run_bench(cfg, log)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def _cmd_fsck(args: argparse.Namespace) -> int:
    from kvstore.fsck import format_report, fsck

    report = fsck(args.dir, progress=progress_bars, repair=args.repair)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.clean else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="Tiered KV-cache store for MLA/DSA models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="the main job with embedded defaults (store walkthrough)")
    run.add_argument("--data-dir", help=f"where the disk tier lives (default {default_data_dir()})")
    run.add_argument("--ephemeral", action="store_true", help="use a fresh temporary data directory")
    run.add_argument("--host-capacity", default="128MiB", help="host tier size (default 128MiB)")
    run.add_argument("--disk-capacity", default="2GiB", help="disk tier size (default 2GiB)")
    run.set_defaults(func=_cmd_run)

    bench = sub.add_parser("bench", help="bandwidth and lookup benchmark with ceilings from the same run")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--blocks", type=int, default=96, help="blocks per pass (default 96, 2.93 MiB each)")
    bench.add_argument("--repeats", type=int, default=3, help="runs per figure; medians are reported (default 3)")
    bench.add_argument("--lookup-tokens", type=int, default=131072, help="prompt length for the lookup figure")
    bench.add_argument("--dir", help="directory on the file system to measure (default: the temp dir)")
    bench.set_defaults(func=_cmd_bench)

    check = sub.add_parser("fsck", help="verify a disk tier directory")
    check.add_argument("dir", help="the disk tier directory (holds segments/ and index/)")
    check.add_argument("--repair", action="store_true", help="drop blocks that fail verification")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(func=_cmd_fsck)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KVStoreError as exc:
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
