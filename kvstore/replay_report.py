"""How replay results are shown: a summary, a sweep table and a hit-rate curve (PNG)."""

from __future__ import annotations

import os
from typing import Sequence

from kvstore.errors import InvalidRequest
from kvstore.replay import ReplayResult

_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_count(text: str) -> int:
    """``"3M"`` -> 3,000,000 tokens (decimal units k, M, G)."""
    raw = text.strip().lower()
    unit = raw[-1] if raw and raw[-1] in "kmg" else ""
    try:
        value = float(raw[: len(raw) - len(unit)]) * _COUNT_UNITS[unit]
    except ValueError:
        raise InvalidRequest(f"cannot read {text!r} as a token count; examples: 3M, 500k, 3000000") from None
    if value <= 0:
        raise InvalidRequest(f"token counts must be positive, got {text!r}")
    return int(value)


def tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 10**6 else f"{n / 1e3:.1f}k"


def format_summary(result: ReplayResult, trace: str) -> str:
    split = ", ".join(f"{name} {tokens(n)}" for name, n in result.tier_capacity_tokens.items())
    lines = [
        f"trace {trace}: {result.requests} requests, {tokens(result.input_tokens)} input tokens",
        f"policy {result.policy}, capacity {tokens(result.capacity_tokens)} tokens ({split}), "
        f"write policy {result.write_policy}",
        f"  token hit rate          {result.hit_rate:7.2%}",
        f"  infinite-capacity max   {result.max_hit_rate:7.2%}",
        f"  fraction of max         {result.fraction_of_max:7.2%}",
    ]
    if result.optimal_hit_rate is not None:
        lines.append(f"  Belady optimum          {result.optimal_hit_rate:7.2%} "
                     f"({result.optimal_hit_tokens / max(result.max_hit_tokens, 1):.2%} of max)")
    lines.append("  hits by tier: " + ", ".join(f"{n} {tokens(t)} tokens" for n, t in result.tier_hit_tokens.items()))
    lines.append(f"  replayed in {result.elapsed_s:.1f} s")
    return "\n".join(lines)


def format_sweep(results: Sequence[ReplayResult]) -> str:
    """Rows: capacities; columns: each policy's hit rate (and fraction of max), then Belady."""
    policies = list(dict.fromkeys(r.policy for r in results))
    by_capacity: dict[int, dict[str, ReplayResult]] = {}
    for r in results:
        by_capacity.setdefault(r.capacity_tokens, {})[r.policy] = r
    header = f"{'capacity':>10}" + "".join(f"{p:>22}" for p in policies) + f"{'belady':>22}"
    lines = ["token hit rate (fraction of the infinite-capacity max)", header]
    for capacity, row in sorted(by_capacity.items()):
        first = next(iter(row.values()))
        cells = [f"{row[p].hit_rate:>12.2%} ({row[p].fraction_of_max:>6.1%})" for p in policies]
        optimal = first.optimal_hit_tokens or 0
        cells.append(f"{optimal / max(first.input_tokens, 1):>12.2%} ({optimal / max(first.max_hit_tokens, 1):>6.1%})")
        lines.append(f"{tokens(capacity):>10}" + "".join(f"{c:>22}" for c in cells))
    first = results[0]
    lines.append(f"infinite-capacity max: {first.max_hit_rate:.2%} of input tokens")
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


def plot_sweep(results: Sequence[ReplayResult], path: str, title: str) -> None:
    """Hit rate against capacity, one line per policy, Belady dashed, the max as a ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for policy in dict.fromkeys(r.policy for r in results):
        points = sorted((r.capacity_tokens, r.hit_rate) for r in results if r.policy == policy)
        ax.plot([c / 1e6 for c, _ in points], [h * 100 for _, h in points], marker="o", label=policy)
    optimal = sorted({(r.capacity_tokens, r.optimal_hit_rate) for r in results if r.optimal_hit_rate is not None})
    ax.plot([c / 1e6 for c, _ in optimal], [h * 100 for _, h in optimal], "k--", marker="x", label="Belady (offline optimum)")
    ax.axhline(results[0].max_hit_rate * 100, color="grey", linestyle=":", label="infinite capacity")
    ax.set_xlabel("cache capacity (million tokens)")
    ax.set_ylabel("token hit rate (% of input tokens)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
