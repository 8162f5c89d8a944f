"""Rendering: the machine context and the table of rows, as a rich terminal table or as Markdown.

Both renderings carry the same cells; Markdown exists so a run can be pasted into docs unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from rich import box
from rich.console import Console
from rich.table import Table

from bench.env import Context
from bench.timing import BLOCKS, CaseStats, Cost, Results, Row

HEADERS = ("benchmark", "baseline", "ops/s", "baseline ops/s", "ratio", "p50 / p99",
           "baseline p50 / p99")


@dataclass(frozen=True)
class Plan:
    """How the run was sized, for the header."""

    redis_iterations: int
    write_iterations: int
    reserve_iterations: int
    backend_iterations: int
    task_iterations: int
    hot_iterations: int
    repeats: int
    warmup_fraction: float
    hot_bursts: tuple[tuple[int, int], ...] = ()  # (task slots, requests a burst) as the hot section ran


def _duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds >= 1:  # end-to-end task latencies in a burst
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.2f} ms"


def _latencies(stats: CaseStats) -> str:
    # A case may not see its operations one by one (tasks that store no result): only its rate is known.
    return f"{_duration(stats.p50)} / {_duration(stats.p99)}" if stats.latencies else "-"


def _cells(row: Row) -> tuple[str, ...]:
    s, b = row.subject, row.baseline
    return (
        s.name,
        b.name,
        f"{s.median_ops:,.0f}",
        f"{b.median_ops:,.0f}",
        f"{row.ratio:.2f}x",
        _latencies(s),
        _latencies(b),
    )


def _sections(rows: list[Row]) -> Iterator[tuple[str, list[Row]]]:
    current: list[Row] = []
    for row in rows:
        if current and current[0].section != row.section:
            yield current[0].section, current
            current = []
        current.append(row)
    if current:
        yield current[0].section, current


def _cost_tables(costs: list[Cost]) -> Iterator[tuple[str, list[str], list[list[str]]]]:
    """Per section: its title, the column headers (case, then every value name in first-seen order)
    and one line per case; a value a case does not have is a dash."""
    sections: dict[str, list[Cost]] = {}
    for cost in costs:
        sections.setdefault(cost.section, []).append(cost)
    for section, entries in sections.items():
        names = list(dict.fromkeys(name for entry in entries for name in entry.values))
        lines = [[entry.case, *(entry.values.get(name, "-") for name in names)] for entry in entries]
        yield section, ["per operation", *names], lines


def context_lines(ctx: Context, plan: Plan, extra: list[str]) -> list[str]:
    """The machine context, then ``extra``: what sections that ran reported about themselves."""
    redis = (f"{ctx.redis_version} at {ctx.redis_url}" if ctx.redis_version
             else f"unavailable at {ctx.redis_url} ({ctx.redis_error})")
    postgres = (f"{ctx.postgres_version} at {ctx.postgres_url}" if ctx.postgres_version
                else f"unavailable at {ctx.postgres_url} ({ctx.postgres_error})")
    packages = ", ".join(f"{name} {ver}" for name, ver in ctx.packages.items())
    hot = (
        " / hot-SKU bursts of " + ", ".join(f"{size} at {slots} slots" for slots, size in plan.hot_bursts)
        if plan.hot_bursts else ""
    )
    return [
        f"Python: {ctx.python} on {ctx.platform}",
        f"CPUs: {ctx.cpus} ({ctx.cpus_usable} usable by this process)",
        f"Redis: {redis}",
        f"PostgreSQL: {postgres}",
        f"SQLite: {ctx.sqlite_version} (file in a temp dir)",
        f"Packages: {packages}",
        f"Code: {ctx.code}",
        (
            f"Method: per run {plan.redis_iterations} Redis pairs / {plan.write_iterations} writes / "
            f"{plan.reserve_iterations} reserves / "
            f"{plan.backend_iterations} backend pairs / {plan.task_iterations} Celery tasks{hot}, after a "
            f"{plan.warmup_fraction:.0%} warm-up; {plan.repeats} runs per case, each run interleaving its "
            f"cases in {BLOCKS} blocks (Celery: one burst per case and run); medians"
        ),
        *extra,
    ]


LEGEND = (
    "ops/s: median over runs. ratio: median over runs of (ops/s ÷ baseline ops/s), both timed "
    "back to back in the same run; below 1.00x means slower than the baseline. "
    "p50 / p99: per-operation latency over all timed iterations."
)


def render_rich(ctx: Context, plan: Plan, results: Results, console: Console) -> None:
    for line in context_lines(ctx, plan, results.context):
        label, _, rest = line.partition(": ")
        console.print(f"[bold]{label}:[/bold] {rest}", highlight=False)
    console.print()
    table = Table(box=box.SIMPLE_HEAVY, show_edge=False, pad_edge=False)
    for i, header in enumerate(HEADERS):
        table.add_column(header, justify="left" if i < 2 else "right", no_wrap=i >= 2)
    for n, (section, rows) in enumerate(_sections(results.rows)):
        if n:
            table.add_section()
        table.add_row(f"[bold cyan]{section}[/bold cyan]", *[""] * (len(HEADERS) - 1))
        for row in rows:
            table.add_row(*_cells(row))
    console.print(table)
    for section, headers, cost_lines in _cost_tables(results.costs):
        console.print()
        costs = Table(box=box.SIMPLE_HEAVY, show_edge=False, pad_edge=False,
                      title=f"[bold cyan]{section}[/bold cyan]", title_justify="left")
        for i, header in enumerate(headers):
            costs.add_column(header, justify="left" if i == 0 else "right")
        for cells in cost_lines:
            costs.add_row(*cells)
        console.print(costs)
    console.print()
    for note in [LEGEND, *results.skipped, *results.notes]:
        console.print(f"• {note}", highlight=False)


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(ctx: Context, plan: Plan, results: Results) -> str:
    lines = [f"- {line}" for line in context_lines(ctx, plan, results.context)]
    lines += ["", "| " + " | ".join(HEADERS) + " |",
              "|" + "|".join(["---", "---", "--:", "--:", "--:", "--:", "--:"]) + "|"]
    for section, rows in _sections(results.rows):
        lines.append(f"| **{_md_escape(section)}** |" + " |" * (len(HEADERS) - 1))
        lines += ["| " + " | ".join(_md_escape(c) for c in _cells(row)) + " |" for row in rows]
    for section, headers, cost_lines in _cost_tables(results.costs):
        lines += ["", f"**{_md_escape(section)}**", "",
                  "| " + " | ".join(_md_escape(h) for h in headers) + " |",
                  "|---|" + "--:|" * (len(headers) - 1)]
        lines += ["| " + " | ".join(_md_escape(c) for c in line) + " |" for line in cost_lines]
    lines.append("")
    lines += [f"- {_md_escape(note)}" for note in [LEGEND, *results.skipped, *results.notes]]
    return "\n".join(lines)
