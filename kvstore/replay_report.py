"""How replay results are shown: a summary, a sweep table with sizing, and a hit-rate curve (PNG).

With a model (``kvstore.sizing``) capacities are also shown in bytes of that model's KV.
"""

from __future__ import annotations

import os
import shutil
from typing import Sequence

from kvstore.errors import InvalidRequest
from kvstore.replay import ReplayResult
from kvstore.replay_windows import ReplayWindow
from kvstore.sizing import bytes_per_token, format_bytes, smallest_capacity_reaching
from kvstore.trace import Trace

SIZING_FRACTIONS = (0.5, 0.75, 0.9)  # of the infinite-capacity maximum


def tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 10**6 else f"{n / 1e3:.1f}k"


def capacity(n: int, model: str | None) -> str:
    """``n`` tokens, and with ``model`` their bytes: ``"3.00M (134.3 GiB)"``."""
    return tokens(n) if model is None else f"{tokens(n)} ({format_bytes(n * bytes_per_token(model))})"


def with_bytes(fields: dict, model: str | None) -> dict:
    """A result's JSON fields, plus its capacities in bytes of ``model``'s KV when one is given."""
    if model is None:
        return fields
    per_token = bytes_per_token(model)
    return {**fields, "model": model, "bytes_per_token": per_token,
            "capacity_bytes": fields["capacity_tokens"] * per_token,
            "tier_capacity_bytes": {name: n * per_token for name, n in fields["tier_capacity_tokens"].items()}}


def trace_fields(trace: Trace) -> dict:
    """What reading the trace found, as JSON fields next to a result's."""
    return {"reordered_requests": trace.reordered_requests, "unhashed_tail_requests": trace.unhashed_tail_requests}


def trace_notes(trace: Trace, block_tokens: int) -> list[str]:
    """One line for each thing reading the trace changed or found (none for a plain trace)."""
    notes = []
    if trace.reordered_requests:
        notes.append(f"{_requests(trace.reordered_requests, 'was', 'were')} out of timestamp order; "
                     "replayed in timestamp order")
    if trace.unhashed_tail_requests:
        notes.append(f"{_requests(trace.unhashed_tail_requests, 'has', 'have')} an unhashed tail (input_length "
                     f"beyond hash ids x {block_tokens} tokens); those tails count as input tokens and are never hit")
    return notes


def _requests(n: int, one: str, many: str) -> str:
    return f"1 request {one}" if n == 1 else f"{n} requests {many}"


def format_summary(result: ReplayResult, trace: str, model: str | None = None) -> str:
    lines = [
        f"trace {trace}: {result.requests} requests, {tokens(result.input_tokens)} input tokens",
        f"policy {result.policy}, capacity {_capacity_line(result, model)}, write policy {result.write_policy}",
        f"  token hit rate          {result.hit_rate:7.2%}",
        f"  infinite-capacity max   {result.max_hit_rate:7.2%}",
        f"  fraction of max         {result.fraction_of_max:7.2%}",
    ]
    if result.optimal_hit_rate is not None:
        lines.append(f"  Belady bound            {result.optimal_hit_rate:7.2%} "
                     f"({result.optimal_fraction_of_max:.2%} of max)")
    lines.append("  hits by tier: " + ", ".join(f"{n} {tokens(t)} tokens" for n, t in result.tier_hit_tokens.items()))
    lines.append(f"  replayed in {result.elapsed_s:.1f} s")
    if result.windows:
        lines.extend(format_windows(result.windows))
    return "\n".join(lines)


def format_windows(windows: Sequence[ReplayWindow]) -> list[str]:
    """One row per stretch of the trace: its requests, timestamps, hit rate and share of its
    maximum, and Belady's schedule's share where it was computed."""
    belady = windows[0].optimal_schedule_hit_tokens is not None
    lines = [f"by stretch of the trace ({len(windows)} of equal request counts):",
             f"  {'requests':>15}  {'timestamps':>23}  {'hit rate':>8}  {'max':>7}  {'of max':>7}"
             + (f"  {'Belady':>7}" if belady else "")]
    for w in windows:
        span = f"{w.first_request}-{w.first_request + w.requests - 1}"
        stamps = f"{_stamp(w.first_timestamp)}-{_stamp(w.last_timestamp)}"
        lines.append(f"  {span:>15}  {stamps:>23}  {w.hit_rate:8.2%}  {w.max_hit_rate:7.2%}  {w.fraction_of_max:7.2%}"
                     + (f"  {w.optimal_schedule_fraction_of_max:7.2%}" if belady else ""))
    if belady:
        lines.append("  (Belady: the share of each stretch's maximum its offline schedule kept; no bound on a "
                     "stretch, as it maximises the whole trace)")
    return lines


def _stamp(timestamp: float) -> str:
    """A trace timestamp as written: whole numbers without a fraction (``1022020``, not ``1.02e+06``)."""
    return f"{timestamp:.0f}" if float(timestamp).is_integer() else f"{timestamp:.3f}"


def _capacity_line(result: ReplayResult, model: str | None) -> str:
    """``"3.00M tokens (host 750.0k, disk 2.25M)"``; with ``model``,
    ``"223.4k tokens (10.0 GiB of deepseek-v3.2 KV; host 223.4k tokens, 10.0 GiB)"``."""
    if model is None:
        split = ", ".join(f"{name} {tokens(n)}" for name, n in result.tier_capacity_tokens.items())
        return f"{tokens(result.capacity_tokens)} tokens ({split})"
    per_token = bytes_per_token(model)
    split = "; ".join(f"{name} {tokens(n)} tokens, {format_bytes(n * per_token)}"
                      for name, n in result.tier_capacity_tokens.items())
    return (f"{tokens(result.capacity_tokens)} tokens ({format_bytes(result.capacity_tokens * per_token)} of "
            f"{model} KV; {split})")


def format_sweep(results: Sequence[ReplayResult], model: str | None = None) -> str:
    """Rows: capacities; columns: each policy's hit rate (and fraction of max), then Belady where
    it was computed; then the sizing table (``format_sizing``)."""
    policies = list(dict.fromkeys(r.policy for r in results))
    by_capacity: dict[int, dict[str, ReplayResult]] = {}
    for r in results:
        by_capacity.setdefault(r.capacity_tokens, {})[r.policy] = r
    with_optimal = any(r.optimal_hit_tokens is not None for r in results)
    width = 10 if model is None else 24
    columns = policies + (["belady"] if with_optimal else [])
    cell = max(22, 2 + max(len(name) for name in columns))  # names apart
    header = f"{'capacity':>{width}}" + "".join(f"{name:>{cell}}" for name in columns)
    lines = ["token hit rate (fraction of the infinite-capacity max)", header]
    for size, row in sorted(by_capacity.items()):
        first = next(iter(row.values()))
        cells = [f"{row[p].hit_rate:>12.2%} ({row[p].fraction_of_max:>6.1%})" for p in policies]
        if with_optimal:
            cells.append(f"{first.optimal_hit_rate:>12.2%} ({first.optimal_fraction_of_max:>6.1%})")
        lines.append(f"{capacity(size, model):>{width}}" + "".join(f"{c:>{cell}}" for c in cells))
    first = results[0]
    lines.append(f"infinite-capacity max: {first.max_hit_rate:.2%} of input tokens")
    return "\n".join(lines + ["", format_sizing(results, model)])


def format_sizing(results: Sequence[ReplayResult], model: str | None = None) -> str:
    """For each fraction of the maximum in ``SIZING_FRACTIONS``: the least capacity measured that
    keeps it, per policy and for Belady's bound where it was computed (what no policy can beat:
    ``kvstore.belady``)."""
    policies = list(dict.fromkeys(r.policy for r in results))
    curves = {p: [(r.capacity_tokens, r.fraction_of_max) for r in results if r.policy == p] for p in policies}
    optimal = sorted({(r.capacity_tokens, r.optimal_fraction_of_max)
                      for r in results if r.optimal_hit_tokens is not None})
    if optimal:
        curves["belady"] = optimal
    width = max(12 if model is None else 26, 2 + max(len(name) for name in curves))  # names apart
    lines = ["capacity to keep a fraction of the max (the least measured that does; the exact one can be "
             "smaller, down to the next capacity measured)", f"{'of max':>8}" + "".join(f"{name:>{width}}" for name in curves)]
    for fraction in SIZING_FRACTIONS:
        cells = []
        for points in curves.values():
            least = smallest_capacity_reaching(points, fraction)
            cells.append("not reached" if least is None else capacity(least, model))
        lines.append(f"{fraction:>8.0%}" + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)


def check_plot_path(path: str) -> None:
    """Raise ``InvalidRequest`` unless ``plot_sweep`` could write ``path`` (its directory exists and
    is writable, and its name ends in a format matplotlib knows); writes nothing."""
    if not path:
        raise InvalidRequest("--plot needs a file name, such as curve.png")
    directory = os.path.dirname(os.path.realpath(path))  # a link's target is what gets written
    if os.path.isdir(path):
        raise InvalidRequest(f"cannot plot to {path!r}: it is a directory; give a file such as curve.png")
    if not os.path.isdir(directory):
        raise InvalidRequest(f"cannot plot to {path}: the directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise InvalidRequest(f"cannot plot to {path}: the directory {directory} is not writable")
    suffix = os.path.splitext(path)[1][1:].lower()
    formats = _plot_formats()
    if not suffix:
        raise InvalidRequest(f"cannot plot to {path}: give the file an extension naming its format, such as "
                             ".png, .svg or .pdf")
    if suffix not in formats:
        raise InvalidRequest(f"cannot plot to {path}: unknown format {suffix!r}; known: {', '.join(sorted(formats))}")


def _plot_formats() -> set[str]:
    """The formats matplotlib writes here: pgf only where a LaTeX it runs is installed."""
    from matplotlib import rcParams
    from matplotlib.backend_bases import FigureCanvasBase

    formats = set(FigureCanvasBase.get_supported_filetypes())
    if shutil.which(rcParams["pgf.texsystem"]) is None:
        formats.discard("pgf")
    return formats


def plot_sweep(results: Sequence[ReplayResult], path: str, title: str, model: str | None = None) -> None:
    """Hit rate against capacity, one line per policy, Belady dashed (if computed), the max as a
    ceiling; with ``model``, a second capacity axis in GiB of its KV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for policy in dict.fromkeys(r.policy for r in results):
        points = sorted((r.capacity_tokens, r.hit_rate) for r in results if r.policy == policy)
        ax.plot([c / 1e6 for c, _ in points], [h * 100 for _, h in points], marker="o", label=policy)
    optimal = sorted({(r.capacity_tokens, r.optimal_hit_rate) for r in results if r.optimal_hit_rate is not None})
    if optimal:
        ax.plot([c / 1e6 for c, _ in optimal], [h * 100 for _, h in optimal], "k--", marker="x",
                label="Belady (offline bound)")
    ax.axhline(results[0].max_hit_rate * 100, color="grey", linestyle=":", label="infinite capacity")
    ax.set_xlabel("cache capacity (million tokens)")
    if model is not None:
        gib_per_million = bytes_per_token(model) * 1e6 / 2**30
        top = ax.secondary_xaxis("top", functions=(lambda m: m * gib_per_million, lambda g: g / gib_per_million))
        top.set_xlabel(f"GiB of {model} KV")
    ax.set_ylabel("token hit rate (% of input tokens)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
