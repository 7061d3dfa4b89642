"""The ``kvstore`` command. Each subcommand parses flags and calls one function; no logic here.

    kvstore run     the main job with embedded defaults: a sidecar with its dashboard, and the
                    engine demo running against it
    kvstore demo    the same, with --quick, --json and sizes
    kvstore bench   bandwidths and lookup time next to their ceilings (--json for one object)
    kvstore fsck    verify a disk tier directory (--repair to drop bad blocks)
    kvstore replay  token hit rate of a policy on a workload trace (--sweep for a curve)
    kvstore trace-gen  write a seeded synthetic trace (multi-turn chat or agent sessions)
    kvstore serve   gRPC sidecar over one store (host + disk tiers)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from typing import Callable

from kvstore.config import parse_size
from kvstore.errors import InvalidRequest, KVStoreError, describe_os_error
from kvstore.policies import DEFAULT_POLICY, POLICIES
from kvstore.service.cli import add_serve_parser  # light: grpc is imported only when serve runs
from kvstore.sizing import MODELS
from kvstore.store import WRITE_POLICIES

RUN_HTTP_ADDRESS = "127.0.0.1:50552"  # `kvstore run`'s dashboard, where `kvstore serve` puts its own by default


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS tells it, else all of them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def progress_bars(label: str, total: int, unit: str = "B") -> Callable[[int], None]:
    """A tqdm bar on a terminal (bytes, or ``unit``), silent elsewhere."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=label, unit=unit, unit_scale=True, disable=None, file=sys.stderr, leave=False)
    return bar.update


def _flag_size(flag: str, text: str) -> int:
    """`parse_size`, its error naming the flag the value came from."""
    try:
        return parse_size(text)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{flag}: {exc}") from None


def _demo_config(args: argparse.Namespace):
    from engine_adapter.demo import DemoConfig

    sizes = dict(host_capacity=_flag_size("--host-capacity", args.host_capacity),
                 disk_capacity=_flag_size("--disk-capacity", args.disk_capacity),
                 data_dir=args.data_dir, v32=args.v32, sidecar=args.sidecar)
    if args.long_prompt_tokens is not None:
        sizes["long_prompt_tokens"] = args.long_prompt_tokens
    return DemoConfig.quick(**sizes) if args.quick else DemoConfig(**sizes)


def _cmd_demo(args: argparse.Namespace) -> int:
    from engine_adapter.demo import run_demo  # the CLI is the one shell over every layer

    say = (lambda s: print(s, file=sys.stderr)) if args.json else print
    result = run_demo(_demo_config(args), say)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    return 0 if result["outputs_identical"] else 1


def _cmd_run(args: argparse.Namespace) -> int:
    """The demo against a sidecar this command starts (unless --sidecar names one or --in-process)."""
    if args.sidecar or args.in_process:
        if args.http_address is not None:  # it would be ignored: this command starts no sidecar then
            started_by = "--sidecar (or KVSTORE_SIDECAR)" if args.sidecar else "--in-process"
            raise InvalidRequest(f"--http-address sets the dashboard of the sidecar `kvstore run` starts, and with "
                                 f"{started_by} it starts none; a running sidecar's dashboard is set by its own "
                                 f"`kvstore serve --http-address`")
        return _cmd_demo(args)
    if args.http_address is None:
        args.http_address = RUN_HTTP_ADDRESS
    _demo_config(args)  # the demo's flags are refused before a sidecar starts, not after
    import tempfile

    say = (lambda s: print(s, file=sys.stderr)) if args.json else print
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="kvstore-run-")
    try:
        return _run_with_sidecar(args, data_dir, say)
    finally:
        if args.data_dir is None:  # a temporary directory: nothing in it outlives the command
            shutil.rmtree(data_dir, ignore_errors=True)


def _run_with_sidecar(args: argparse.Namespace, data_dir: str, say) -> int:
    from kvstore.service.local import LocalSidecar

    with LocalSidecar(data_dir, args.host_capacity, args.disk_capacity, http_address=args.http_address) as sidecar:
        temporary = " (temporary: removed at the end; --data-dir keeps one)" if args.data_dir is None else ""
        say(f"sidecar: gRPC on {sidecar.address}, disk tier in {os.path.join(data_dir, 'disk')}{temporary}")
        if sidecar.url is not None:  # None: --http-address off
            say(f"dashboard: {sidecar.url}  (live while the demo runs; metrics at {sidecar.url}metrics)")
        args.sidecar = sidecar.address
        code = _cmd_demo(args)
        if sidecar.url is not None and sys.stdin.isatty() and not args.json:
            say(f"the sidecar keeps serving the dashboard at {sidecar.url}; press Ctrl-C to stop it")
            try:
                sidecar.process.wait()
            except KeyboardInterrupt:
                pass
    return code


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvstore.bench import BLOCK_TOKENS as LOOKUP_BLOCK_TOKENS, BenchConfig, format_table, run_bench

    disk_blocks = 1 if args.disk_blocks is None else args.disk_blocks  # None: the default, 0 is refused
    if min(args.blocks, args.repeats, args.read_rounds, args.lookup_tokens, disk_blocks) <= 0:
        raise InvalidRequest("--blocks, --disk-blocks, --repeats, --read-rounds and --lookup-tokens must be positive")
    if args.lookup_tokens < LOOKUP_BLOCK_TOKENS:
        raise InvalidRequest(f"--lookup-tokens must be at least one {LOOKUP_BLOCK_TOKENS}-token block, "
                             f"got {args.lookup_tokens}")
    if args.dir is not None and not os.path.isdir(args.dir):
        raise InvalidRequest(f"--dir {args.dir} is not a directory; give an existing one to measure")
    if args.sidecar:
        from kvstore.sidecar_bench import redis_server_binary

        redis_server_binary()  # before the minutes of the store's benchmark, not after
    cfg = BenchConfig(blocks=args.blocks, disk_blocks=args.disk_blocks, repeats=args.repeats,
                      read_rounds=args.read_rounds, lookup_tokens=args.lookup_tokens, directory=args.dir)
    log = (lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr))
    result = run_bench(cfg, log)
    if args.sidecar:
        from kvstore.sidecar_bench import format_sidecar, run_sidecar_bench

        result["sidecar"] = run_sidecar_bench(min(args.blocks, 48), args.repeats, log=log)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
        if args.sidecar:
            print(format_sidecar(result["sidecar"]))
    return 0


def _cmd_fsck(args: argparse.Namespace) -> int:
    from kvstore.fsck import format_report, fsck

    report = fsck(args.dir, progress=progress_bars, repair=args.repair)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.clean else 1


# The tiers a replay can split its capacity over: the store's (HostTier.name, DiskTier.name), fastest first.
REPLAY_TIERS = ("host", "disk")
SWEEP_FLAGS = ("capacities", "policies", "plot", "jobs")


def _cmd_replay(args: argparse.Namespace) -> int:
    """Everything the flags alone can refuse is refused before the trace is read, and every
    capacity before the first replay runs."""
    from kvstore.replay import default_capacities, replay, sweep
    from kvstore.replay_report import (check_plot_path, format_summary, format_sweep, plot_sweep, trace_fields,
                                       trace_notes, with_bytes)
    from kvstore.trace import read_trace

    _check_replay_flags(args)
    if args.plot is not None:
        check_plot_path(args.plot)  # before the sweep, which can take minutes
    tiers = _replay_tiers(args.tiers)
    capacities = _replay_capacities(args, tiers)
    policies = _sweep_policies(args.policies) if args.sweep else [args.policy or DEFAULT_POLICY]
    trace = read_trace(args.trace, args.block_tokens)
    requests = trace.requests
    if not requests:
        raise InvalidRequest(f"trace {args.trace} holds no requests")
    for note in trace_notes(trace, args.block_tokens):
        print(f"kvstore replay: {note}", file=sys.stderr)
    capacities = list(dict.fromkeys(capacities or default_capacities(requests, args.block_tokens, tiers)))
    bar = progress_bars("replaying", len(requests) * len(capacities) * len(policies), unit=" requests")
    options = dict(tiers=tiers, write_policy=args.write_policy, block_tokens=args.block_tokens,
                   with_optimal=not args.no_optimal, progress=bar)
    if args.sweep:
        jobs = args.jobs if args.jobs is not None else usable_cpus()
        results = sweep(requests, capacities, policies, jobs=jobs, **options)
    else:
        results = [replay(requests, capacities[0], policies[0], windows=args.windows or 0, **options)]
    dicts = [{**with_bytes(r.as_dict(), args.model), **trace_fields(trace)} for r in results]
    if args.json:
        print(json.dumps(dicts if args.sweep else dicts[0], indent=2))
    else:
        print(format_sweep(results, args.model) if args.sweep else format_summary(results[0], args.trace, args.model))
    if args.plot is not None:  # after the results are out, so a failing plot loses nothing
        plot_sweep(results, args.plot, f"{os.path.basename(args.trace)}: hit rate against capacity", args.model)
    return 0


def _replay_capacities(args: argparse.Namespace, tiers) -> list[int]:
    """The capacities given, each checked against ``tiers``; none for a sweep over the defaults."""
    from kvstore.replay import tier_slots
    from kvstore.sizing import parse_capacity

    if args.capacities is not None and not args.capacities.strip():
        raise InvalidRequest("--capacities is empty: give capacities such as 1M,3M,8M, or leave it out for 5%..100% "
                             "of the footprint")
    texts = (args.capacities.split(",") if args.capacities else []) if args.sweep else [args.capacity_tokens]
    capacities = [parse_capacity(text, args.model) for text in texts]
    for capacity in capacities:
        tier_slots(capacity, tiers, args.block_tokens)
    return capacities


def _sweep_policies(text: str | None) -> list[str]:
    """``--policies`` (default: all), each once; unknown ones refused before any replay runs."""
    if text is not None and not text.strip():
        raise InvalidRequest(f"--policies is empty: give some of {', '.join(sorted(POLICIES))}, or leave it out for all")
    policies = list(dict.fromkeys(text.split(","))) if text else sorted(POLICIES)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise InvalidRequest(f"--policies: unknown {', '.join(map(repr, unknown))}; "
                             f"give some of {', '.join(sorted(POLICIES))}")
    return policies


def _check_replay_flags(args: argparse.Namespace) -> None:
    if args.jobs is not None and args.jobs < 1:
        raise InvalidRequest(f"--jobs must be at least 1, got {args.jobs}")
    if args.block_tokens <= 0:
        raise InvalidRequest(f"--block-tokens must be positive, got {args.block_tokens}")
    if args.windows is not None and args.windows < 1:
        raise InvalidRequest(f"--windows must be at least 1, got {args.windows}")
    if args.sweep and args.capacity_tokens is not None:
        raise InvalidRequest("--capacity-tokens is for one replay; with --sweep give --capacities (e.g. 1M,2M,4M)")
    if args.sweep and args.policy is not None:
        raise InvalidRequest("--policy is for one replay; with --sweep give --policies (e.g. lru,adaptive)")
    if args.sweep and args.windows is not None:
        raise InvalidRequest("--windows is for one replay: drop --sweep, or give --capacity-tokens and no --sweep")
    if not args.sweep and not args.capacity_tokens:
        raise InvalidRequest("give --capacity-tokens N (e.g. 3M), or --sweep for a range of capacities")
    given = [f"--{name}" for name in SWEEP_FLAGS if getattr(args, name) is not None]
    if given and not args.sweep:
        raise InvalidRequest(f"{', '.join(given)}: only with --sweep (add --sweep for a curve over capacities)")


def _replay_tiers(text: str):
    """``--tiers`` as a ``TierSplit``, its names checked against ``REPLAY_TIERS`` (in that order)."""
    from kvstore.replay import TierSplit

    names = [part.partition("=")[0].strip() for part in text.split(",")]
    usage = f"give tiers from {', '.join(REPLAY_TIERS)}, fastest first, e.g. host=0.25,disk=0.75"
    if "" in names:
        raise InvalidRequest(f"--tiers {text!r} has an empty tier name; {usage}")
    unknown = [name for name in names if name not in REPLAY_TIERS]
    if unknown:
        raise InvalidRequest(f"--tiers: unknown tier {unknown[0]!r}; {usage}")
    if names != sorted(names, key=REPLAY_TIERS.index):
        raise InvalidRequest(f"--tiers {text!r} is out of order; {usage}")
    return TierSplit.parse(text)


def _cmd_trace_gen(args: argparse.Namespace) -> int:
    from kvstore.synthetic_traces import GENERATORS
    from kvstore.trace import write_trace

    requests = GENERATORS[args.kind](args.seed)
    to_stdout = args.out == "-"
    write_trace(sys.stdout if to_stdout else args.out, requests)
    distinct = len({h for r in requests for h in r["hash_ids"]})
    print(f"wrote {len(requests)} requests ({distinct} distinct blocks) to {'standard output' if to_stdout else args.out}",
          file=sys.stderr if to_stdout else sys.stdout)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="Tiered KV-cache store for MLA/DSA models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    for name, text in (("run", "the main job with embedded defaults: the engine demo over the store"),
                       ("demo", "bundled engine over the store: multi-turn chat and long-prompt TTFT")):
        demo = sub.add_parser(name, help=text)
        demo.add_argument("--json", action="store_true", help="print one JSON object (the table goes to stderr)")
        demo.add_argument("--quick", action="store_true", help="a tiny model and short prompts (seconds)")
        demo.add_argument("--v32", action="store_true", help="DeepSeek-V3.2-shaped model with the DSA indexer")
        demo.add_argument("--long-prompt-tokens", type=int, help="long-prompt case length in tokens, at least 128 (default 4096; 1024 with --quick)")
        demo.add_argument("--data-dir", help="store directory (default: a fresh temporary directory)")
        demo.add_argument("--host-capacity", default="512MiB", help="host tier size (default 512MiB)")
        demo.add_argument("--disk-capacity", default="4GiB", help="disk tier size (default 4GiB)")
        demo.add_argument("--sidecar", default=os.environ.get("KVSTORE_SIDECAR"),
                          help="use a running `kvstore serve` (HOST:PORT or unix:PATH; env KVSTORE_SIDECAR) "
                               "instead of an in-process store; the data-dir and capacity flags then do nothing")
        if name == "run":
            demo.add_argument("--http-address", help=f"where the started sidecar serves its dashboard, or off "
                                                     f"(default {RUN_HTTP_ADDRESS})")
            demo.add_argument("--in-process", action="store_true",
                              help="an in-process store instead of a sidecar (adds the disk-tier TTFT case)")
        demo.set_defaults(func=_cmd_run if name == "run" else _cmd_demo)

    bench = sub.add_parser("bench", help="bandwidth and lookup benchmark with ceilings from the same run")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--blocks", type=int, default=96, help="blocks per pass (default 96, 2.93 MiB each)")
    bench.add_argument("--disk-blocks", type=int, help="blocks per disk pass (default 4 x --blocks: 1.1 GiB)")
    bench.add_argument("--repeats", type=int, default=4, help="runs per figure; medians are reported (default 4)")
    bench.add_argument("--read-rounds", type=int, default=4,
                       help="cold-read samples of the store and of the ceiling per run, in ABBA order (default 4)")
    bench.add_argument("--lookup-tokens", type=int, default=131072, help="prompt length for the lookup figure")
    bench.add_argument("--dir", help="directory on the file system to measure (default: the temp dir)")
    bench.add_argument("--sidecar", action="store_true", help="also the sidecar's paths (shared memory, gRPC) "
                       "against memcpy, loopback TCP and a real redis-server (needs redis-server and redis-py)")
    bench.set_defaults(func=_cmd_bench)

    check = sub.add_parser("fsck", help="verify a disk tier directory")
    check.add_argument("dir", help="the disk tier directory (holds segments/ and index/)")
    check.add_argument("--repair", action="store_true", help="drop blocks that fail verification")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(func=_cmd_fsck)

    rep = sub.add_parser("replay", help="token hit rate of an eviction policy on a Mooncake-format trace")
    rep.add_argument("trace", help="JSONL trace: timestamp, input_length, output_length, hash_ids per line")
    rep.add_argument("--capacity-tokens", help="cache capacity in tokens (e.g. 3M), or in bytes with --model "
                                               "(e.g. 128GiB)")
    rep.add_argument("--model", choices=list(MODELS),
                     help="show capacities in bytes of this model's KV too, and accept them in bytes")
    rep.add_argument("--policy", choices=sorted(POLICIES), help=f"one replay's policy (default {DEFAULT_POLICY})")
    rep.add_argument("--tiers", default="host", help="capacity split over tiers, fastest first, e.g. host=0.25,disk=0.75 (default host: one tier)")
    rep.add_argument("--write-policy", default="on_eviction", choices=WRITE_POLICIES,
                     help="on_eviction (default: victims are demoted, so the tiers hold disjoint "
                          "blocks but for promoted ones) or write_through")
    rep.add_argument("--block-tokens", type=int, default=512, help="tokens per trace block (default 512)")
    rep.add_argument("--no-optimal", action="store_true", help="skip Belady's offline optimum (with --sweep too)")
    rep.add_argument("--sweep", action="store_true", help="hit rate at several capacities for each policy")
    rep.add_argument("--capacities", help="with --sweep: comma-separated capacities, tokens or bytes as for "
                                          "--capacity-tokens (default: 5%%..100%% of the footprint)")
    rep.add_argument("--policies", help="with --sweep: comma-separated policies (default: all)")
    rep.add_argument("--plot", help="with --sweep: write the hit-rate curve to this file (.png, .svg, .pdf, ...)")
    rep.add_argument("--jobs", type=int, help="with --sweep: replays run at once, one process each "
                     "(default: one per CPU this process may use)")
    rep.add_argument("--windows", type=int, help="also the hit rate of this many stretches of the trace, of "
                                                 "equal request counts (warm-up against steady state)")
    rep.add_argument("--json", action="store_true", help="print JSON")
    rep.set_defaults(func=_cmd_replay)

    gen = sub.add_parser("trace-gen", help="write a seeded synthetic trace in the Mooncake format")
    gen.add_argument("kind", choices=["chat", "agent"], help="multi-turn chat or agent sessions")
    gen.add_argument("--seed", type=int, default=0, help="the draw of the generator (default 0)")
    gen.add_argument("--out", required=True, help="JSONL file to write (- for standard output)")
    gen.set_defaults(func=_cmd_trace_gen)

    add_serve_parser(sub)
    for command in sub.choices.values():  # -v after the subcommand too; SUPPRESS keeps a -v given before it
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log at INFO level")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, not at exit: a reader gone by then is a BrokenPipeError caught below
        return code
    except KVStoreError as exc:
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of standard output went away (``| head``): no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 141  # as a shell reports SIGPIPE
    except OSError as exc:  # a path that does not exist, is a directory, or may not be written
        print(f"kvstore {args.command}: {describe_os_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
