"""The kvstore command, run as a real process: run, bench --json, fsck, and bad input."""

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kvstore(*args, env=None, timeout=180):
    environment = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=environment)


def test_run_is_the_engine_demo_and_reports_json(tmp_path):
    done = kvstore("run", "--quick", "--json", "--data-dir", str(tmp_path), "--http-address", "off")
    assert done.returncode == 0, done.stderr
    assert f"disk tier in {tmp_path / 'disk'}" in done.stderr  # it said DIR, and fsck DIR found no tier there
    assert "dashboard" not in done.stderr and "None" not in done.stderr  # it printed 'dashboard: None
    result = json.loads(done.stdout)
    assert result["outputs_identical"] is True and result["prefill_tokens_reused"] > 0
    for key in ("prefill_tokens_computed", "ttft_cold_s", "ttft_hit_s", "ttft_resident_s", "model_config"):
        assert key in result
    assert "same as cold" in done.stderr  # the human table goes to stderr with --json
    check = kvstore("fsck", str(tmp_path / "disk"), "--json")
    assert check.returncode == 0 and json.loads(check.stdout)["clean"] is True


def test_bench_json_reports_every_figure_and_ratio(tmp_path):
    done = kvstore("bench", "--json", "--blocks", "3", "--repeats", "1", "--lookup-tokens", "4096", "--dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "not a whole number" not in done.stderr  # the host tier it sizes for itself is whole pages
    result = json.loads(done.stdout)
    for ratio in ("host_load_vs_memcpy", "disk_read_vs_ceiling", "disk_write_vs_ceiling",
                  "lookup_speedup_vs_sha256", "disk_bytes_per_payload_byte"):
        assert result["ratios"][ratio] > 0 and ratio in result["targets_met"]
    assert result["block"]["block_bytes"] == 3_076_352
    assert 1.0 <= result["ratios"]["disk_bytes_per_payload_byte"] < 1.5
    assert len(result["figures"]["disk_samples_gbps"]["read_cold"]) == result["repeats"] * result["read_rounds"]
    assert len(result["figures"]["disk_samples_gbps"]["write_unaligned"]) == result["repeats"]
    assert result["figures"]["disk_write_unaligned_gbps"] > 0 and "bounce" in result["method"]["write"]
    assert result["figures"]["lookup_tokens"] == 4096 and result["figures"]["lookup_blocks"] == 4096 // 64
    assert os.listdir(tmp_path) == [], "the benchmark cleans up its files"


def test_bench_table_is_human_readable(tmp_path):
    done = kvstore("bench", "--blocks", "2", "--repeats", "1", "--lookup-tokens", "2048", "--dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "host load" in done.stdout and "O_DIRECT" in done.stdout and "ratio" in done.stdout
    assert "lookup 2K tokens" in done.stdout, "the lookup row names the prompt length measured, not 128K"


@pytest.mark.parametrize("args, message", [
    (("bench", "--blocks", "0"), "must be positive"),
    (("demo", "--quick", "--host-capacity", "lots"), "--host-capacity: cannot read 'lots' as a size"),
    (("demo", "--quick", "--disk-capacity", "3X"), "--disk-capacity: cannot read '3X' as a size"),
    (("run", "--quick", "--in-process", "--http-address", "127.0.0.1:0"), "with --in-process it starts none"),
    (("run", "--quick", "--sidecar", "127.0.0.1:1", "--http-address", "off"), "with --sidecar"),
    (("run", "--quick", "--long-prompt-tokens", "5"), "must be at least 128"),  # was refused once a sidecar ran
    (("run", "--quick", "--host-capacity", "3MM"), "--host-capacity: cannot read '3MM' as a size"),  # was a list
    (("bench", "--blocks", "1", "--disk-blocks", "0"), "must be positive"),  # 0 was taken as the default
    (("bench", "--blocks", "1", "--lookup-tokens", "10"), "--lookup-tokens must be at least one 64-token block"),
])
def test_bad_flags_give_a_clear_error_and_exit_2(args, message):
    done = kvstore(*args)
    assert done.returncode == 2 and message in done.stderr


def test_fsck_of_a_non_tier_exits_2(tmp_path):
    done = kvstore("fsck", str(tmp_path))
    assert done.returncode == 2 and "not a kvstore disk tier" in done.stderr


@pytest.mark.parametrize("repeat", [0, 1])
@pytest.mark.parametrize("rounds", [2, 4, 6])
def test_cold_read_order_gives_each_side_as_many_even_slots_as_odd(repeat, rounds):
    """A disk whose reads alternate fast and slow must not favour either side (bench.read_order)."""
    from kvstore.bench import read_order

    order = read_order(repeat, rounds)
    assert order.count("store") == order.count("ceiling") == rounds
    for side in ("store", "ceiling"):
        slots = [i for i, name in enumerate(order) if name == side]
        assert sum(i % 2 for i in slots) * 2 == len(slots), (side, order)


def test_three_rounds_would_favour_one_side():
    from kvstore.bench import read_order

    slots = [i for i, name in enumerate(read_order(0, 3)) if name == "ceiling"]
    assert sum(i % 2 == 0 for i in slots) == 2  # two of three in the same phase: why the default is even


@pytest.fixture
def trace(tmp_path):
    from kvstore.trace import write_trace

    path = tmp_path / "t.jsonl"
    write_trace(str(path), [{"timestamp": t, "input_length": 1500, "output_length": 10, "hash_ids": [1, 2, t]}
                            for t in range(3, 9)])
    return str(path)


def run_main(capsys, *args):
    """``kvstore ARGS`` in this process: (exit code, stdout, stderr)."""
    from kvstore.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args, message", [
    (("--tiers", "bogus"), "unknown tier 'bogus'; give tiers from host, disk"),
    (("--tiers", ""), "--tiers '' has an empty tier name"),
    (("--tiers", "host=0.5,=0.5"), "has an empty tier name"),
    (("--tiers", "disk=0.5,host=0.5"), "is out of order"),
    (("--block-tokens", "0"), "--block-tokens must be positive, got 0"),
    (("--block-tokens", "-512"), "--block-tokens must be positive, got -512"),
    (("--plot", "c.png"), "--plot: only with --sweep"),
    (("--capacities", "1k,2k", "--policies", "lru"), "--capacities, --policies: only with --sweep"),
    (("--jobs", "2"), "--jobs: only with --sweep"),
    (("--sweep", "--jobs", "0"), "--jobs must be at least 1, got 0"),
    (("--sweep",), "--capacity-tokens is for one replay; with --sweep give --capacities"),
    (("--windows", "0"), "--windows must be at least 1, got 0"),
    (("--windows", "7"), "--windows 7: the trace holds only 6 requests, so give at most 6 windows"),
])
def test_replay_refuses_flags_it_would_ignore_or_misread(capsys, trace, args, message):
    code, out, err = run_main(capsys, "replay", trace, "--capacity-tokens", "3k", *args)
    assert (code, out) == (2, "") and err.startswith("kvstore replay: ") and err.count("\n") == 1
    assert message in err


def test_windows_are_for_one_replay(capsys, trace):
    code, out, err = run_main(capsys, "replay", trace, "--sweep", "--capacities", "3k", "--windows", "2")
    assert (code, out) == (2, "") and "--windows is for one replay" in err


def test_replay_shows_the_hit_rate_of_each_stretch_of_the_trace(capsys, trace):
    code, out, err = run_main(capsys, "replay", trace, "--capacity-tokens", "4k", "--windows", "2")
    assert code == 0, err
    table = out[out.index("by stretch of the trace (2 of equal request counts):"):].splitlines()
    assert table[1].split()[-1] == "Belady"
    assert table[2].split()[:2] == ["0-2", "3-5"] and table[3].split()[:2] == ["3-5", "6-8"]  # requests, timestamps
    code, out, err = run_main(capsys, "replay", trace, "--capacity-tokens", "4k", "--windows", "2", "--no-optimal")
    assert code == 0 and "by stretch" in out and "Belady" not in out, err
    code, out, err = run_main(capsys, "replay", trace, "--capacity-tokens", "4k", "--windows", "2", "--json")
    result = json.loads(out)
    assert [w["requests"] for w in result["windows"]] == [3, 3]
    assert sum(w["hit_tokens"] for w in result["windows"]) == result["hit_tokens"] > 0


def test_replay_accepts_the_store_tiers_fastest_first(capsys, trace):
    code, out, err = run_main(capsys, "replay", trace, "--capacity-tokens", "4k", "--tiers", "host=0.5,disk=0.5",
                              "--json")
    assert code == 0, err
    assert list(json.loads(out)["tier_capacity_tokens"]) == ["host", "disk"]


@pytest.mark.parametrize("plot, message", [
    ("missing/c.png", "the directory {tmp}/missing does not exist"),
    (".", "is a directory"),
    ("c.txt", "unknown format 'txt'"),
])
def test_a_bad_plot_path_is_refused_before_the_sweep_runs(capsys, monkeypatch, tmp_path, trace, plot, message):
    import kvstore.replay

    def sweep(*args, **kw):
        raise AssertionError("the sweep ran before the plot path was checked")

    monkeypatch.setattr(kvstore.replay, "sweep", sweep)
    code, out, err = run_main(capsys, "replay", trace, "--sweep", "--capacities", "2k", "--plot",
                              str(tmp_path / plot))
    assert (code, out) == (2, "") and message.format(tmp=tmp_path) in err


@pytest.mark.parametrize("make_args, message", [
    (lambda tmp: ("replay", str(tmp), "--capacity-tokens", "1M"), "kvstore replay: cannot access {tmp}: Is a directory"),
    (lambda tmp: ("trace-gen", "chat", "--out", f"{tmp}/missing/x.jsonl"),
     "kvstore trace-gen: cannot access {tmp}/missing/x.jsonl: No such file or directory"),
    (lambda tmp: ("bench", "--dir", f"{tmp}/missing", "--blocks", "2", "--repeats", "1", "--read-rounds", "2"),
     "kvstore bench: --dir {tmp}/missing is not a directory; give an existing one to measure"),
    (lambda tmp: ("serve", "--data-dir", f"{tmp}/t.jsonl", "--host-capacity", "0", "--disk-capacity", "64MiB",
                  "--http-address", "off", "--address", "127.0.0.1:0"),
     "kvstore serve: cannot access {tmp}/t.jsonl/disk: Not a directory"),
])
def test_a_path_the_os_refuses_is_one_line_and_exit_2(capsys, tmp_path, trace, make_args, message):
    code, out, err = run_main(capsys, *make_args(tmp_path))
    assert (code, out) == (2, "") and err == message.format(tmp=tmp_path) + "\n"


def test_a_missing_shared_memory_directory_is_one_line_without_a_traceback(tmp_path):
    done = kvstore("serve", "--host-capacity", "4MiB", "--disk-capacity", "0", "--http-address", "off",
                   "--address", "127.0.0.1:0", env={"KVSTORE_SHM_DIR": str(tmp_path / "missing")}, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"kvstore serve: KVSTORE_SHM_DIR: '{tmp_path}/missing' does not exist; "
                           f"give an existing directory, as a tmpfs like /dev/shm\n")  # names the variable set


def test_replay_with_a_model_takes_and_shows_capacities_in_bytes(capsys, trace):
    per_token = 48068  # deepseek-v3.2: 61 layers x (656 fp8 MLA + 132 fp8 indexer) bytes
    code, out, err = run_main(capsys, "replay", trace, "--capacity-tokens", f"{4000 * per_token}B",
                              "--model", "deepseek-v3.2", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["capacity_tokens"] == 4000 and result["capacity_bytes"] == 4000 * per_token
    assert result["tier_capacity_bytes"] == {"host": result["tier_capacity_tokens"]["host"] * per_token}
    code, out, err = run_main(capsys, "replay", trace, "--capacity-tokens", "4k", "--model", "deepseek-v3.2")
    assert code == 0 and "capacity 4.0k tokens (183.4 MiB of deepseek-v3.2 KV" in out


def test_a_sweep_says_what_capacity_keeps_each_fraction_of_the_max(capsys, trace):
    # six requests share blocks 1 and 2 (1024 tokens, always hit after the first); one block's
    # room keeps block 1 (half the max), 1.5k tokens hold both
    code, out, err = run_main(capsys, "replay", trace, "--sweep", "--capacities", "512,1.5k,10k", "--policies", "lru",
                              "--model", "deepseek-v3")
    assert code == 0, err
    sizing = out[out.index("capacity to keep a fraction of the max"):].splitlines()
    assert sizing[1].split() == ["of", "max", "lru", "belady"]
    assert sizing[2].split()[:3] == ["50%", "0.5k", "(34.3"]  # 512 tokens x 70,272 bytes = 34.3 MiB
    assert sizing[3].split()[:3] == ["75%", "1.5k", "(100.5"]  # 1,500 tokens x 70,272 bytes = 100.5 MiB
    assert [row.split()[0] for row in sizing[2:]] == ["50%", "75%", "90%"]


def test_a_sweep_refuses_an_unknown_policy_before_replaying(capsys, monkeypatch, trace):
    import kvstore.replay

    monkeypatch.setattr(kvstore.replay, "replay", lambda *a, **kw: pytest.fail("a replay ran"))
    code, out, err = run_main(capsys, "replay", trace, "--sweep", "--capacities", "2k", "--policies", "lru,nope")
    assert (code, out) == (2, "") and "--policies: unknown 'nope'; give some of adaptive, hit_density" in err


@pytest.mark.parametrize("args, message", [
    (("--capacities", ""), "--capacities is empty: give capacities such as 1M,3M,8M, or leave it out"),
    (("--capacities", " "), "--capacities is empty"),
    (("--policies", ""), "--policies is empty: give some of adaptive, hit_density"),
])
def test_a_sweep_refuses_an_empty_list_rather_than_taking_the_defaults(capsys, monkeypatch, trace, args, message):
    """Before, an empty --capacities or --policies (a shell variable left unset) silently swept the defaults."""
    import kvstore.replay

    monkeypatch.setattr(kvstore.replay, "replay", lambda *a, **kw: pytest.fail("a replay ran"))
    code, out, err = run_main(capsys, "replay", trace, "--sweep", *args)
    assert (code, out) == (2, "") and message in err and err.count("\n") == 1


def test_a_capacity_in_bytes_needs_a_model(capsys, trace):
    code, out, err = run_main(capsys, "replay", trace, "--capacity-tokens", "1GiB")
    assert (code, out) == (2, "") and "'1GiB' is a size in bytes: give --model" in err


def test_serve_refuses_a_shutdown_grace_that_is_not_finite_seconds(tmp_path):
    """Before, inf was taken (and so was nan): a SIGTERM'd sidecar would wait on its calls forever."""
    done = kvstore("serve", "--shutdown-grace-s", "inf", "--data-dir", str(tmp_path), "--host-capacity", "4MiB",
                   "--disk-capacity", "16MiB", "--http-address", "off", "--address", "127.0.0.1:0", timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("kvstore serve: the shutdown grace must be finite seconds, 0 or more, got inf; "
                           "--shutdown-grace-s or KVSTORE_SHUTDOWN_GRACE_S\n")


@pytest.mark.parametrize("args, verbose", [
    (("serve", "-v"), True), (("-v", "serve"), True), (("serve", "--verbose"), True), (("serve",), False),
    (("fsck", "DIR", "-v"), True), (("-v", "fsck", "DIR"), True), (("fsck", "DIR"), False),
])
def test_verbose_is_taken_before_or_after_the_subcommand(args, verbose):
    """Before, `kvstore serve -v` was refused ("unrecognized arguments: -v") while `kvstore -v serve` worked."""
    from kvstore.cli import build_parser

    assert build_parser().parse_args(list(args)).verbose is verbose


def test_the_serve_usage_in_its_docstring_names_every_flag():
    """The usage at the top of kvstore/service/cli.py had left out --check-integrity-on-exit."""
    import argparse

    import kvstore.service.cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_serve_arguments(parser)
    usage = serve_cli.__doc__.split("\n\n")[1]
    assert set(re.findall(r"--[a-z-]+", usage)) == set(re.findall(r"--[a-z-]+", parser.format_usage()))


@pytest.mark.parametrize("keep", [False, True])
def test_run_removes_the_temporary_directory_it_made_and_keeps_a_given_one(tmp_path, monkeypatch, keep):
    """The sidecar and demo are stubbed: only what `kvstore run` does with its directory is tested."""
    import tempfile

    from kvstore import cli

    made = []

    def fake_run(args, data_dir, say):
        made.append(data_dir)
        open(os.path.join(data_dir, "segment"), "w").close()  # what a disk tier leaves
        raise RuntimeError("the demo failed")  # removed even then
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(cli, "_run_with_sidecar", fake_run)
    given = tmp_path / "given"
    given.mkdir()
    args = cli.build_parser().parse_args(["run", "--quick"] + (["--data-dir", str(given)] if keep else []))
    with pytest.raises(RuntimeError):
        cli._cmd_run(args)
    assert os.path.exists(made[0]) == keep and (made[0] == str(given)) == keep


def test_trace_gen_writes_standard_output_with_out_dash(capsys, tmp_path):
    """Before, --out - wrote a file named '-'; now the trace goes to standard output, the summary
    to standard error, and the trace reads back as the one written to a file."""
    from kvstore.trace import read_trace

    code, out, err = run_main(capsys, "trace-gen", "agent", "--seed", "2", "--out", "-")
    assert code == 0 and err.startswith("wrote ") and err.rstrip().endswith("to standard output")
    (tmp_path / "piped.jsonl").write_text(out)
    assert run_main(capsys, "trace-gen", "agent", "--seed", "2", "--out", str(tmp_path / "file.jsonl"))[0] == 0
    piped, written = (read_trace(str(tmp_path / name)).requests for name in ("piped.jsonl", "file.jsonl"))
    assert piped == written and len(piped) > 100 and not (tmp_path / "-").exists()


@pytest.mark.parametrize("read_first", [100, 0])
def test_a_closed_pipe_ends_the_command_quietly(tmp_path, read_first):
    """``kvstore ... | head``: before, a BrokenPipeError became 'kvstore trace-gen: [Errno 32] Broken
    pipe' on standard error (a long output, read in part) or Python's 'Exception ignored ...' and
    exit code 120 (a short one, still buffered when the command returned; buffered as a pipe's is
    by default, so PYTHONUNBUFFERED is unset here)."""
    import os
    import subprocess
    import sys

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"input_length": 600, "hash_ids": [1, 2]}\n' * 3)
    command = (["trace-gen", "chat", "--out", "-"] if read_first else
               ["replay", str(trace), "--capacity-tokens", "2k", "--policy", "lru"])
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    gen = subprocess.Popen([sys.executable, "-m", "kvstore", *command], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env=env)
    gen.stdout.read(read_first)
    gen.stdout.close()
    _, err = gen.communicate(timeout=120)
    assert gen.returncode == 141 and err == b""


@pytest.mark.parametrize("tokens", ["0", "-5", "10", "127"])
def test_a_long_prompt_too_short_for_a_cached_page_and_a_suffix_is_refused(capsys, tokens):
    """Before: 0 was taken for the default, -5 and 10 ended in a traceback (a negative tensor
    dimension; an empty prompt)."""
    code, out, err = run_main(capsys, "demo", "--quick", "--long-prompt-tokens", tokens)
    assert (code, out) == (2, "")
    assert "--long-prompt-tokens) must be at least 128" in err and f"got {tokens}" in err


def test_bench_sidecar_without_redis_py_is_refused_before_the_benchmark_runs(tmp_path):
    """It was refused after the whole store benchmark had run, its figures thrown away."""
    fake = tmp_path / "redis"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('redis-py is not installed here')\n")
    done = kvstore("bench", "--blocks", "2", "--sidecar", env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"},
                   timeout=60)
    assert done.returncode == 2 and "needs redis-py" in done.stderr
    assert "host tier" not in done.stderr, "nothing was measured first"
