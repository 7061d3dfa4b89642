"""How replay results are shown: a summary, a sweep table with sizing, and a hit-rate curve (PNG).

With a model (``kvstore.sizing``) capacities are also shown in bytes of that model's KV.
"""

from __future__ import annotations

import os
from typing import Sequence

from kvstore.errors import InvalidRequest
from kvstore.replay import ReplayResult
from kvstore.sizing import bytes_per_token, format_bytes, smallest_capacity_reaching

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


def format_summary(result: ReplayResult, trace: str, model: str | None = None) -> str:
    split = ", ".join(f"{name} {capacity(n, model)}" for name, n in result.tier_capacity_tokens.items())
    lines = [
        f"trace {trace}: {result.requests} requests, {tokens(result.input_tokens)} input tokens",
        f"policy {result.policy}, capacity {capacity(result.capacity_tokens, model)} tokens"
        + (f" of {model} KV" if model else "") + f" ({split}), write policy {result.write_policy}",
        f"  token hit rate          {result.hit_rate:7.2%}",
        f"  infinite-capacity max   {result.max_hit_rate:7.2%}",
        f"  fraction of max         {result.fraction_of_max:7.2%}",
    ]
    if result.optimal_hit_rate is not None:
        lines.append(f"  Belady bound            {result.optimal_hit_rate:7.2%} "
                     f"({result.optimal_hit_tokens / max(result.max_hit_tokens, 1):.2%} of max)")
    lines.append("  hits by tier: " + ", ".join(f"{n} {tokens(t)} tokens" for n, t in result.tier_hit_tokens.items()))
    lines.append(f"  replayed in {result.elapsed_s:.1f} s")
    return "\n".join(lines)


def format_sweep(results: Sequence[ReplayResult], model: str | None = None) -> str:
    """Rows: capacities; columns: each policy's hit rate (and fraction of max), then Belady; then
    the sizing table (``format_sizing``)."""
    policies = list(dict.fromkeys(r.policy for r in results))
    by_capacity: dict[int, dict[str, ReplayResult]] = {}
    for r in results:
        by_capacity.setdefault(r.capacity_tokens, {})[r.policy] = r
    width = 10 if model is None else 24
    header = f"{'capacity':>{width}}" + "".join(f"{p:>22}" for p in policies) + f"{'belady':>22}"
    lines = ["token hit rate (fraction of the infinite-capacity max)", header]
    for size, row in sorted(by_capacity.items()):
        first = next(iter(row.values()))
        cells = [f"{row[p].hit_rate:>12.2%} ({row[p].fraction_of_max:>6.1%})" for p in policies]
        optimal = first.optimal_hit_tokens or 0
        cells.append(f"{optimal / max(first.input_tokens, 1):>12.2%} ({optimal / max(first.max_hit_tokens, 1):>6.1%})")
        lines.append(f"{capacity(size, model):>{width}}" + "".join(f"{c:>22}" for c in cells))
    first = results[0]
    lines.append(f"infinite-capacity max: {first.max_hit_rate:.2%} of input tokens")
    return "\n".join(lines + ["", format_sizing(results, model)])


def format_sizing(results: Sequence[ReplayResult], model: str | None = None) -> str:
    """For each fraction of the maximum in ``SIZING_FRACTIONS``: the least capacity measured that
    keeps it, per policy and for Belady's bound (what no policy can beat: ``kvstore.belady``)."""
    policies = list(dict.fromkeys(r.policy for r in results))
    curves = {p: [(r.capacity_tokens, r.fraction_of_max) for r in results if r.policy == p] for p in policies}
    curves["belady"] = sorted({(r.capacity_tokens, r.optimal_hit_tokens / max(r.max_hit_tokens, 1))
                               for r in results if r.optimal_hit_tokens is not None})
    width = 12 if model is None else 26
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
    is writable, and matplotlib knows its format); writes nothing."""
    directory = os.path.dirname(os.path.abspath(path))
    if not path or os.path.isdir(path):
        raise InvalidRequest(f"cannot plot to {path!r}: it is a directory; give a file such as curve.png")
    if not os.path.isdir(directory):
        raise InvalidRequest(f"cannot plot to {path}: the directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise InvalidRequest(f"cannot plot to {path}: the directory {directory} is not writable")
    suffix = os.path.splitext(path)[1][1:].lower()
    formats = _plot_formats()
    if suffix and suffix not in formats:
        raise InvalidRequest(f"cannot plot to {path}: unknown format {suffix!r}; known: {', '.join(sorted(formats))}")


def _plot_formats() -> set[str]:
    from matplotlib.backend_bases import FigureCanvasBase

    return set(FigureCanvasBase.get_supported_filetypes())


def plot_sweep(results: Sequence[ReplayResult], path: str, title: str, model: str | None = None) -> None:
    """Hit rate against capacity, one line per policy, Belady dashed, the max as a ceiling; with
    ``model``, a second capacity axis in GiB of its KV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for policy in dict.fromkeys(r.policy for r in results):
        points = sorted((r.capacity_tokens, r.hit_rate) for r in results if r.policy == policy)
        ax.plot([c / 1e6 for c, _ in points], [h * 100 for _, h in points], marker="o", label=policy)
    optimal = sorted({(r.capacity_tokens, r.optimal_hit_rate) for r in results if r.optimal_hit_rate is not None})
    ax.plot([c / 1e6 for c, _ in optimal], [h * 100 for _, h in optimal], "k--", marker="x", label="Belady (offline bound)")
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
