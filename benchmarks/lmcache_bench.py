"""LMCache store and retrieve through our plugin against LMCache's own Redis connector, one run.

    python benchmarks/lmcache_bench.py [--json] [--prompts 3] [--tokens 1024] [--repeats 5]

Starts a sidecar (``python -m kvstore.service``, host tier only) and a ``redis-server`` (no
persistence), both memory-only on loopback, then one real LMCache engine process per backend
(the LMCache environment: ``make lmcache-venv``, or ``KVSTORE_LMCACHE_PYTHON``):

    kvstore        our plugin, same-host shared memory (its default)
    kvstore-grpc   our plugin with shared_memory off: every byte through gRPC, as from another host
    redis          LMCache's RedisConnector (remote_url: redis://) against the redis-server
    local-cpu      no remote at all: LMCache's own CPU backend, the ceiling of any remote backend

Each engine stores ``prompts`` prompts of ``tokens`` tokens of DeepSeek-V3 (61 layers of bf16 MLA:
70,272 bytes per token) from a paged CPU cache and retrieves each into a fresh paged cache at other
slots, checked bit-exact. ``store`` is ``engine.store`` until every remote put has finished;
``retrieve`` is ``engine.retrieve`` (its own lookup included); ``lookup`` is ``engine.lookup``.
Every repeat uses new prompts (nothing is a duplicate); one warm-up prompt goes first. Medians of
per-prompt times over all repeats, seed fixed. Needs the Debian ``redis-server`` package.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from connectors.lmcache.config import plugin_extra_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "deepseek-ai/DeepSeek-V3"
LAYERS = 61
BYTES_PER_TOKEN = LAYERS * 576 * 2
SEED = 0
BACKENDS = ("kvstore", "kvstore-grpc", "redis", "local-cpu")
TARGET_RETRIEVE_SPEEDUP = 1.5


# ---- the engine process (LMCache environment) ---------------------------------------------


def engine_main(args: dict) -> dict:
    """Store then retrieve ``repeats`` rounds of fresh prompts; per-prompt seconds for each op."""
    import connectors.lmcache  # noqa: F401  (first: the sidecar client beside LMCache's older protobuf)
    from connectors.lmcache import cpu_engine as lmc

    tokens, prompts = args["tokens"], args["prompts"]
    slots = 2 * tokens
    total_gb = (args["repeats"] * prompts + 1) * tokens * BYTES_PER_TOKEN / 1e9
    if args["remote"] == "local":
        config = lmc.LMCacheEngineConfig.from_dict({"chunk_size": lmc.CHUNK_TOKENS, "local_cpu": True,
                                                    "max_local_cpu_size": total_gb + 0.5, "save_unfull_chunk": True})
    else:
        config = lmc.lmcache_config(args["remote"], cpu_buffer_gb=0.5)
    engine = lmc.build_engine("bench", config, lmc.mla_metadata(MODEL, LAYERS))
    puts = lmc.PutTracker(engine)
    source, target = lmc.paged_cache(LAYERS, slots), lmc.paged_cache(LAYERS, slots)
    times: dict[str, list[float]] = {"store": [], "lookup": [], "retrieve": []}

    def one_round(seeds: list[int], record: bool) -> None:
        batch = [lmc.make_prompt(seed, tokens, LAYERS) for seed in seeds]
        for seed, prompt in zip(seeds, batch):
            start = time.perf_counter()
            lmc.store_prompt(engine, prompt, source, lmc.slot_mapping(seed, tokens, slots))
            puts.wait()
            stored_s = time.perf_counter() - start
            if record:
                times["store"].append(stored_s)
        for seed, prompt in zip(seeds, batch):
            for layer in target:
                layer.zero_()
            start = time.perf_counter()
            found = engine.lookup(prompt.tokens)
            lookup_s = time.perf_counter() - start
            other_slots = lmc.slot_mapping(seed + 1, tokens, slots)
            start = time.perf_counter()
            retrieved = lmc.retrieve_prompt(engine, prompt, target, other_slots)
            retrieve_s = time.perf_counter() - start
            exact = lmc.holds_prompt(target, other_slots, prompt, retrieved)
            if (found, retrieved, exact) != (tokens, tokens, True):
                raise RuntimeError(f"prompt {seed}: looked up {found}, retrieved {retrieved} of {tokens}, "
                                   f"exact={exact}")
            if record:
                times["lookup"].append(lookup_s)
                times["retrieve"].append(retrieve_s)

    one_round([SEED - 1], record=False)
    for repeat in range(args["repeats"]):
        one_round([SEED + repeat * prompts + p for p in range(prompts)], record=True)
    return times


# ---- the driver (this project's environment) ----------------------------------------------


def lmcache_python() -> str:
    path = os.environ.get("KVSTORE_LMCACHE_PYTHON") or os.path.join(REPO, ".venv-lmcache", "bin", "python")
    if not os.access(path, os.X_OK):
        sys.exit("no LMCache environment: run `make lmcache-venv` (or set KVSTORE_LMCACHE_PYTHON)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sidecar(data_dir: str, capacity: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "kvstore.service", "--address", "127.0.0.1:0",
                                "--http-address", "off", "--data-dir", data_dir, "--host-capacity", capacity,
                                "--disk-capacity", "0"], stdout=subprocess.PIPE, text=True, cwd=REPO,
                               env={**os.environ, "PYTHONPATH": REPO})
    line = process.stdout.readline()
    if "listening on" not in line:
        process.kill()
        sys.exit(f"the sidecar did not start: {line!r}")
    return process, line.split("listening on ", 1)[1].strip()


def start_redis() -> tuple[subprocess.Popen, int]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.access(binary, os.X_OK):
        sys.exit("the benchmark compares with redis-server: apt-get install redis-server")
    port = free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--loglevel", "warning"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return process, port
        except OSError:
            time.sleep(0.05)
    process.kill()
    sys.exit("redis-server did not answer PING")


def run_engine(python: str, remote, args: argparse.Namespace) -> dict[str, list[float]]:
    request = {"remote": remote, "tokens": args.tokens, "prompts": args.prompts, "repeats": args.repeats}
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONHASHSEED": "0", "LMCACHE_LOG_LEVEL": "WARNING"}
    done = subprocess.run([python, os.path.abspath(__file__), "--engine", json.dumps(request)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"the LMCache engine process failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summarize(times: dict[str, list[float]], prompt_bytes: int) -> dict[str, float]:
    out = {}
    for op, seconds in times.items():
        median = statistics.median(seconds)
        out[f"{op}_ms"] = round(median * 1e3, 2)
        if op != "lookup":
            out[f"{op}_gbps"] = round(prompt_bytes / median / 1e9, 3)
    return out


def run(args: argparse.Namespace) -> dict:
    python = lmcache_python()
    prompt_bytes = args.tokens * BYTES_PER_TOKEN
    stored_gib = (args.repeats * args.prompts + 1) * prompt_bytes * 1.1 / 2**30
    remotes = {}
    with tempfile.TemporaryDirectory(prefix="lmcache-bench-") as data_dir:
        sidecar, address = start_sidecar(data_dir, f"{max(1, int(stored_gib * 2) + 1)}GiB")
        redis, port = start_redis()
        try:
            remotes = {"kvstore": plugin_extra_config(address),
                       "kvstore-grpc": plugin_extra_config(address, shared_memory=False),
                       "redis": {"remote_url": f"redis://127.0.0.1:{port}"},
                       "local-cpu": "local"}
            results = {name: summarize(run_engine(python, remotes[name], args), prompt_bytes)
                       for name in args.backends}
        finally:
            for process in (sidecar, redis):
                process.terminate()
                process.wait(60)
    result = {"model": MODEL, "layers": LAYERS, "tokens_per_prompt": args.tokens, "prompts": args.prompts,
              "repeats": args.repeats, "prompt_bytes": prompt_bytes, "results": results,
              "retrieve_target": TARGET_RETRIEVE_SPEEDUP}
    if {"kvstore", "redis"} <= set(results):
        ours, redis_row = results["kvstore"], results["redis"]
        for op in ("retrieve", "store", "lookup"):
            result[f"{op}_speedup_vs_redis"] = round(redis_row[f"{op}_ms"] / ours[f"{op}_ms"], 2)
    return result


def format_table(result: dict) -> str:
    title = (f"LMCache, {result['model']} ({result['layers']} layers, bf16 MLA): {result['prompts']} prompts of "
             f"{result['tokens_per_prompt']} tokens ({result['prompt_bytes'] / 1e6:.1f} MB) x {result['repeats']} "
             "repeats, per-prompt medians")
    lines = [title, f"{'backend':<14}{'store ms':>10}{'GB/s':>8}{'retrieve ms':>13}{'GB/s':>8}{'lookup ms':>11}"]
    for name, row in result["results"].items():
        lines.append(f"{name:<14}{row['store_ms']:>10.1f}{row['store_gbps']:>8.2f}{row['retrieve_ms']:>13.1f}"
                     f"{row['retrieve_gbps']:>8.2f}{row['lookup_ms']:>11.2f}")
    if "retrieve_speedup_vs_redis" not in result:
        return "\n".join(lines)
    met = "met" if result["retrieve_speedup_vs_redis"] >= result["retrieve_target"] else "NOT met"
    lines.append(f"kvstore vs redis: retrieve {result['retrieve_speedup_vs_redis']}x (target "
                 f">= {result['retrieve_target']}x: {met}), store {result['store_speedup_vs_redis']}x, "
                 f"lookup {result['lookup_speedup_vs_redis']}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=3, help="prompts per repeat (default 3)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per prompt (default 1024: 4 chunks)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of fresh prompts (default 5)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                        help="which to run (default: all; the ratios need kvstore and redis)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # internal: run as the LMCache engine process
    args = parser.parse_args(argv)
    if args.engine:
        code = 0
        try:
            print("RESULT " + json.dumps(engine_main(json.loads(args.engine))), flush=True)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # LMCache leaves non-daemon threads running
    result = run(args)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
