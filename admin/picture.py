"""A SKU-by-SKU timeline as an SVG picture: token epochs as bands, accepted writes as dots, refused stale
writes as red crosses, and accepted writes that went behind a newer token (possible only without the
fence) as orange triangles. Plain SVG text, so it needs no plotting library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path

from reservations.values import HistoryEntry

WIDTH, LANE, LEFT, TOP = 1000, 46, 90, 40
BANDS = ("#dbe9f6", "#f1e3c8")


def timeline_svg(title: str, histories: Mapping[str, Sequence[HistoryEntry]]) -> str:
    entries = [h for rows in histories.values() for h in rows if h.operation != "create"]
    start = min((h.at for h in entries), default=0.0)
    end = max((h.at for h in entries), default=start + 1.0)
    span = max(end - start, 1e-3)
    height = TOP + LANE * len(histories) + 40

    def x(at: float) -> float:
        return LEFT + (WIDTH - LEFT - 20) * (at - start) / span

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif"'
        ' font-size="11">',
        f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
        f'<text x="{WIDTH - 10}" y="20" text-anchor="end">{span:.1f} s; bands = token epochs; '
        "dot = accepted write; x = stale write refused; triangle = accepted behind a newer token</text>",
    ]
    for lane, (sku, rows) in enumerate(histories.items()):
        y = TOP + lane * LANE
        out.append(f'<text x="10" y="{y + 24}">{escape(sku)}</text>')
        writes = [h for h in rows if h.kind == "write" and h.operation != "create"]
        # An epoch's band runs from its first accepted write to the next epoch's first one.
        firsts: list[tuple[int, float]] = []
        for h in writes:
            if not firsts or h.token != firsts[-1][0]:
                firsts.append((h.token, h.at))
        for n, (token, at) in enumerate(firsts):
            until = firsts[n + 1][1] if n + 1 < len(firsts) else end
            out.append(
                f'<rect x="{x(at):.1f}" y="{y + 6}" width="{max(x(until) - x(at), 1):.1f}" height="30" '
                f'fill="{BANDS[n % 2]}"><title>token {token}</title></rect>'
            )
        highest = 0
        for h in writes:
            if h.token < highest:
                cx, cy = x(h.at), y + 21
                out.append(
                    f'<polygon points="{cx - 6:.1f},{cy + 6} {cx + 6:.1f},{cy + 6} {cx:.1f},{cy - 7}" '
                    f'fill="#f08c00"><title>{escape(h.operation)} with token {h.token} after {highest}'
                    "</title></polygon>"
                )
            else:
                out.append(
                    f'<circle cx="{x(h.at):.1f}" cy="{y + 21}" r="3" fill="#2b8a3e">'
                    f"<title>{escape(h.operation)} token {h.token}</title></circle>"
                )
            highest = max(highest, h.token)
        for h in rows:
            if h.kind == "rejected":
                cx, cy = x(h.at), y + 21
                out.append(
                    f'<path d="M{cx - 5:.1f},{cy - 5} L{cx + 5:.1f},{cy + 5} M{cx - 5:.1f},{cy + 5} '
                    f'L{cx + 5:.1f},{cy - 5}" stroke="#c92a2a" stroke-width="2"><title>{escape(h.operation)}'
                    f" token {h.token} refused, highest {h.highest_token}</title></path>"
                )
    out.append("</svg>")
    return "\n".join(out)


def save_timeline(path: Path, title: str, histories: Mapping[str, Sequence[HistoryEntry]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(timeline_svg(title, histories), encoding="utf-8")
    return path
