#!/usr/bin/env python3
"""A picture of the stack's dashboard without Grafana: every panel of the `dashboard` output, its queries
run over the last minutes against the stack's Prometheus (its HTTP API, /api/v1/query_range), drawn as one
self-contained HTML page (inline SVG, no script, nothing fetched when it is opened), laid out by the
panels' gridPos as Grafana lays them out (24 columns). For an issue, a chat, a diagnostics bundle, or a
headless browser's screenshot:

    python3 scripts/dashboard_snapshot.py --stack prod --out dashboard.html
    python3 scripts/dashboard_snapshot.py --dashboard board.json --prometheus http://spark-02.lan:9090 --out d.html
    chromium --headless --screenshot=dashboard.png --window-size=1280,1400 dashboard.html

Prints a line per panel (its series and points) and exits 1 with --require-data when a panel drew nothing.
Grafana's $__rate_interval becomes --rate-interval (Grafana's own is at least four scrape intervals).
Standard library only."""

from __future__ import annotations

import argparse
import html
import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

COLUMNS, WIDTH, ROW_PX = 24, 1240, 34  # Grafana's grid: 24 columns; a grid row is about 30 px there
COLORS = ["#7eb26d", "#eab839", "#6ed0e0", "#ef843c", "#e24d42", "#1f78c1", "#ba43a9", "#705da0"]
Fetch = Callable[[str, dict[str, str]], dict[str, Any]]


@dataclass
class Series:
    legend: str
    points: list[tuple[float, float]]


@dataclass
class Panel:
    title: str
    unit: str
    grid: dict[str, int]
    series: list[Series] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def legend_of(template: str, labels: dict[str, str], fallback: str) -> str:
    """Grafana's legendFormat: {{label}} replaced by the series' label (empty when it has none)."""
    if not template:
        return fallback
    return re.sub(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def collect(board: dict[str, Any], fetch: Fetch, end: float, minutes: int, rate_interval: str) -> list[Panel]:
    start, step = end - minutes * 60, max(1, minutes * 60 // 240)
    panels = []
    for spec in board.get("panels", []):
        unit = spec.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        panel = Panel(spec.get("title", ""), unit, spec.get("gridPos", {"x": 0, "y": 0, "w": 12, "h": 8}))
        for target in spec.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", rate_interval)
            params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": str(step)}
            try:
                answer = fetch("/api/v1/query_range", params)
            except Exception as error:  # noqa: BLE001 - a panel that cannot be read says why; the rest draw
                panel.errors.append(f"{target.get('refId', '?')}: {error}")
                continue
            if answer.get("status") != "success":
                panel.errors.append(f"{target.get('refId', '?')}: {answer.get('error', answer)}")
                continue
            for row in answer["data"]["result"]:
                points = [(float(t), float(v)) for t, v in row["values"] if v not in ("NaN", "+Inf", "-Inf")]
                if points:
                    name = legend_of(target.get("legendFormat", ""), row["metric"], expr)
                    panel.series.append(Series(name, points))
        panels.append(panel)
    return panels


def human(value: float, unit: str) -> str:
    if unit == "bytes":
        for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= scale:
                return f"{value / scale:.1f} {suffix}"
        return f"{value:.0f} B"
    if unit == "s":
        return f"{value * 1000:.1f} ms" if abs(value) < 1 else f"{value:.2f} s"
    if unit == "percentunit":
        return f"{value * 100:.0f}%"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.2f}".rstrip("0").rstrip(".")


def svg(panel: Panel, width: int, height: int, start: float, end: float) -> str:
    left, right, top, bottom = 70, 10, 8, 22
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [v for s in panel.series for _, v in s.points]
    low, high = min([0.0, *values]), max([0.0, *values])
    if panel.unit == "percentunit" or high - low < 1e-9:  # a percentage to 100 %; a flat line on 0…1
        high = max(high, low + 1.0)
    x = lambda t: left + (t - start) / (end - start) * plot_w  # noqa: E731 - two local scales read best inline
    y = lambda v: top + plot_h - (v - low) / (high - low) * plot_h  # noqa: E731
    parts = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">']
    for frac in (0.0, 0.5, 1.0) if panel.series else ():
        value = low + (high - low) * frac
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(value):.1f}" y2="{y(value):.1f}" class="grid"/>')
        parts.append(f'<text x="{left - 6}" y="{y(value) + 4:.1f}" class="axis" text-anchor="end">'
                     f"{html.escape(human(value, panel.unit))}</text>")  # fmt: skip
    for frac in (0.0, 0.5, 1.0):
        stamp = time.strftime("%H:%M", time.gmtime(start + (end - start) * frac))
        anchor = ("start", "middle", "end")[int(frac * 2)]
        parts.append(f'<text x="{left + plot_w * frac:.1f}" y="{height - 6}" class="axis" text-anchor="{anchor}">'
                     f"{stamp}</text>")  # fmt: skip
    for index, series in enumerate(panel.series):
        line = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in series.points)
        color = COLORS[index % len(COLORS)]
        parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="1.6"/>')
    if not panel.series:
        parts.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h / 2}" class="empty" '
                     f'text-anchor="middle">No data</text>')  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)


STYLE = """body{background:#111217;color:#ccccdc;font:13px/1.3 DejaVu Sans,Helvetica,Arial,sans-serif;margin:12px}
h1{font-size:17px;font-weight:500;margin:0 0 2px}.sub{color:#8e8e9e;margin-bottom:10px}
.board{position:relative}.panel{position:absolute;box-sizing:border-box;background:#181b1f;
border:1px solid #2c3235;border-radius:3px;padding:6px 8px}.title{font-weight:500;margin-bottom:2px}
.grid{stroke:#2c3235}.axis{fill:#8e8e9e;font-size:11px}.empty{fill:#8e8e9e;font-size:14px}
.legend{font-size:11px;white-space:nowrap;overflow:hidden}.legend span{margin-right:10px}
.legend i{display:inline-block;width:10px;height:3px;margin-right:4px;vertical-align:middle}
.error{color:#e24d42;font-size:11px}"""


def page(board: dict[str, Any], panels: list[Panel], source: str, start: float, end: float) -> str:
    cell = WIDTH / COLUMNS
    blocks, bottom = [], 0
    for panel in panels:
        g = panel.grid
        left, top, width, height = g["x"] * cell, g["y"] * ROW_PX, g["w"] * cell - 8, g["h"] * ROW_PX - 8
        bottom = max(bottom, top + height)
        legend = "".join(
            f'<span><i style="background:{COLORS[n % len(COLORS)]}"></i>{html.escape(s.legend)} '
            f"{html.escape(human(s.points[-1][1], panel.unit))}</span>"
            for n, s in enumerate(panel.series)
        )
        errors = "".join(f'<div class="error">{html.escape(e)}</div>' for e in panel.errors)
        drawing = svg(panel, int(width) - 18, int(height) - 58, start, end)
        blocks.append(
            f'<div class="panel" style="left:{left:.0f}px;top:{top:.0f}px;width:{width:.0f}px;height:{height:.0f}px">'
            f'<div class="title">{html.escape(panel.title)}</div>{drawing}'
            f'<div class="legend">{legend}</div>{errors}</div>'
        )  # fmt: skip
    span = f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(start))} – {time.strftime('%H:%M', time.gmtime(end))} UTC"
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(board.get("title", ""))}</title>'
        f"<style>{STYLE}</style></head><body><h1>{html.escape(board.get('title', ''))}</h1>"
        f'<div class="sub">{html.escape(span)} · from {html.escape(source)} · drawn by scripts/dashboard_snapshot.py'
        f'</div><div class="board" style="height:{bottom:.0f}px">{"".join(blocks)}</div></body></html>'
    )  # fmt: skip


def http_fetch(base: str, timeout: float = 15) -> Fetch:
    def fetch(path: str, params: dict[str, str]) -> dict[str, Any]:
        url = f"{base.rstrip('/')}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=timeout) as answer:  # noqa: S310 - the user's own Prometheus
            return json.loads(answer.read())

    return fetch


def stack_output(stack: str, name: str) -> Any:
    done = subprocess.run(["pulumi", "stack", "output", name, "--json", "--stack", stack],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"pulumi stack output {name} --stack {stack}: {done.stderr.strip()}")
    return json.loads(done.stdout)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", help="read `dashboard` and `metrics.prometheus` from this stack's outputs")
    parser.add_argument("--dashboard", help="the dashboard JSON (a file, or - for standard input)")
    parser.add_argument("--prometheus", help="the Prometheus to ask (the `metrics.prometheus` output)")
    parser.add_argument("--minutes", type=int, default=15, help="how far back (default 15)")
    parser.add_argument("--rate-interval", default="1m", help="what $__rate_interval becomes (default 1m)")
    parser.add_argument("--out", required=True, help="the HTML file to write")
    parser.add_argument("--require-data", action="store_true", help="exit 1 when a panel drew nothing")
    args = parser.parse_args(argv)
    if args.stack:
        board = stack_output(args.stack, "dashboard") if not args.dashboard else None
        prometheus = args.prometheus or (stack_output(args.stack, "metrics") or {}).get("prometheus")
    else:
        board, prometheus = None, args.prometheus
    if board is None:
        if not args.dashboard:
            parser.error("--dashboard or --stack is needed")
        board = json.load(sys.stdin if args.dashboard == "-" else open(args.dashboard))
    if not prometheus:
        parser.error("--prometheus or a stack with metrics.prometheusNode is needed")
    end = time.time()
    panels = collect(board, http_fetch(prometheus), end, args.minutes, args.rate_interval)
    with open(args.out, "w") as out:
        out.write(page(board, panels, prometheus, end - args.minutes * 60, end))
    for panel in panels:
        points = sum(len(s.points) for s in panel.series)
        print(f"{panel.title}: {len(panel.series)} series, {points} points" + "".join(f"; {e}" for e in panel.errors))
    empty = [panel.title for panel in panels if not panel.series]
    if empty:
        print(f"no data in: {', '.join(empty)}", file=sys.stderr)
    return 1 if args.require_data and empty else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
