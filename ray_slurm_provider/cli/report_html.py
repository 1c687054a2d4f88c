"""`ray-slurm report --html`: one self-contained page (inline CSS and SVG, no script, nothing
fetched) from the report's data (cli/report.py): the totals, the per-type table, and a
timeline with one bar per node job, split into queued / starting / Ray up, coloured by how
the job ended, grouped by node type."""

from __future__ import annotations

import time
from collections.abc import Callable
from html import escape
from typing import Any

from ray_slurm_provider.units import fmt_duration

#: How a job ended -> its colour (colour-blind safe Tableau 10).
COLOURS = {"autoscaler": "#4e79a7", "ray down": "#59a14f", "scancel": "#f28e2b",
           "walltime": "#edc948", "preemption": "#b07aa1", "node failure": "#e15759",
           "failure": "#9c2b2b", "completed": "#76b7b2", "unknown": "#8c8c8c",
           "active": "#2f6fdf"}
QUEUED = "#d9d9d9"
WIDTH = 1100
LABEL = 170
_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px;margin:0 0 4px}
.sub{color:#666;margin-bottom:16px}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin-bottom:16px}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 14px;min-width:110px}
.card b{display:block;font-size:20px}
table{border-collapse:collapse;margin-bottom:16px}
th,td{border-bottom:1px solid #eee;padding:4px 10px;text-align:right}
th:first-child,td:first-child{text-align:left}
.legend span{display:inline-block;margin-right:14px}
.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-1px}
.notes{color:#8a5a00}
svg text{font:11px system-ui,sans-serif;fill:#333}
"""


def _d(s: float | None) -> str:
    return "-" if s is None else fmt_duration(round(s))


def _card(label: str, value: str) -> str:
    return f'<div class="card"><b>{escape(value)}</b>{escape(label)}</div>'


def _timeline(data: dict[str, Any]) -> str:
    """The SVG: one `g.job` per job (its three parts as rects), a heading per type."""
    jobs = data["jobs"]
    start = float(data["started"])
    end = max(start + 1.0, float(data["ended"] or data["now"]))
    span = end - start
    row = 14 if len(jobs) <= 200 else max(2, 2800 // max(1, len(jobs)))
    plot = WIDTH - LABEL - 10

    def x(t: float) -> float:
        return LABEL + plot * (min(max(t, start), end) - start) / span

    parts: list[str] = []
    y = 24
    for k in range(5):  # the time axis: 0, 1/4 ... of the wall time
        tx = LABEL + plot * k / 4
        anchor = "end" if k == 4 else "middle"
        parts.append(f'<line x1="{tx:.1f}" y1="14" x2="{tx:.1f}" y2="{{H}}" stroke="#eee"/>'
                     f'<text x="{tx:.1f}" y="11" text-anchor="{anchor}">'
                     f'+{escape(_d(span * k / 4))}</text>')
    for node_type in data["types"]:
        mine = [j for j in jobs if j["type"] == node_type]
        parts.append(f'<text class="type" x="4" y="{y + 11}" font-weight="bold">'
                     f'{escape(node_type)} ({len(mine)})</text>')
        y += 16
        for j in mine:
            parts.append(_bar(j, x, y, row, data["now"]))
            y += row + (1 if row > 3 else 0)
        y += 6
    height = y + 4
    body = "".join(parts).replace("{H}", str(height))
    return (f'<svg width="{WIDTH}" height="{height}" '
            f'role="img" aria-label="timeline">{body}</svg>')


def _bar(j: dict[str, Any], x: Callable[[float], float], y: int, row: int, now: float) -> str:
    colour = COLOURS.get(j["end"], COLOURS["unknown"])
    stop = j["ended"] or now
    sub = j["submitted"] or j["started"] or stop
    segs = []
    started = j["started"]
    up = j["ray_up"]
    if started is None:
        segs.append(("queued", sub, stop, QUEUED, 1.0))
    else:
        segs.append(("queued", sub, started, QUEUED, 1.0))
        segs.append(("starting", started, up or stop, colour, 0.45))
        if up:
            segs.append(("up", up, stop, colour, 1.0))
    rects = "".join(
        f'<rect class="{cls}" x="{x(a):.1f}" y="{y}" width="{max(0.5, x(b) - x(a)):.1f}" '
        f'height="{row}" fill="{fill}" fill-opacity="{op}"/>'
        for cls, a, b, fill, op in segs if b >= a)
    label = ""
    if row >= 10:
        label = (f'<text x="{LABEL - 6}" y="{y + row - 3}" text-anchor="end">'
                 f'{escape(j["job"])}</text>')
    tip = (f"job {j['job']} ({j['type']}): {j['end']}; queued "
           f"{_d((started or stop) - sub)}, starting "
           f"{_d(((up or stop) - started) if started else None)}, Ray up "
           f"{_d((stop - up) if up else None)}")
    return (f'<g class="job" data-job="{escape(j["job"])}" data-type="{escape(j["type"])}" '
            f'data-end="{escape(j["end"])}"><title>{escape(tip)}</title>{label}{rects}</g>')


def render(data: dict[str, Any]) -> str:
    types = data["types"]
    node_h = sum(t["node_hours"] for t in types.values())
    gpu_h = sum(t["gpu_hours"] for t in types.values())
    billing = [t["billing_hours"] for t in types.values() if t["billing_hours"] is not None]
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data["started"]))
    cards = [_card("node jobs", str(sum(t["jobs"] for t in types.values()))),
             _card("wall time", _d(data["wall_s"])),
             _card("node-hours", f"{node_h:.2f}"), _card("GPU-hours", f"{gpu_h:.2f}")]
    if billing:
        cards.append(_card("billing-hours", f"{sum(billing):.1f}"))
    if data["folded_jobs"]:
        cards.append(_card("folded into totals", str(data["folded_jobs"])))
    rows = "".join(
        f"<tr><td>{escape(k)}</td><td>{t['jobs']}</td><td>{_d(t['queue_wait_median_s'])}</td>"
        f"<td>{_d(t['queue_wait_max_s'])}</td><td>{_d(t['startup_median_s'])}</td>"
        f"<td>{t['node_hours']:.2f}</td><td>{t['gpu_hours']:.2f}</td>"
        f"<td>{escape(', '.join(f'{e} {n}' for e, n in t['ended_by'].items()) or '-')}</td></tr>"
        for k, t in types.items())
    used = {j["end"] for j in data["jobs"]}
    legend = "".join(f'<span><i style="background:{c}"></i>{escape(k)}</span>'
                     for k, c in COLOURS.items() if k in used)
    legend += (f'<span><i style="background:{QUEUED}"></i>queued</span>'
               '<span>light: starting (start to Ray up), full: Ray up</span>')
    said = list(data["notes"])
    if data["folded_jobs"]:
        said.append(f"{data['folded_jobs']} older jobs are folded into the totals: they have "
                    "no bar")
    if data["bad_lines"]:
        said.append(f"{data['bad_lines']} unreadable lines of the records were skipped")
    notes = "".join(f"<li>{escape(n)}</li>" for n in said)
    state = "running" if not data["ended"] else "ended " + time.strftime(
        "%Y-%m-%d %H:%M:%S", time.localtime(data["ended"]))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>ray-slurm report: {escape(data.get('cluster', ''))} {escape(data['run'])}</title>
<style>{_CSS}</style></head><body>
<h1>{escape(data.get('cluster', ''))}: run {escape(data['run'])}</h1>
<div class="sub">started {escape(when)}, {state}</div>
<div class="cards" id="totals">{''.join(cards)}</div>
<table id="types"><tr><th>type</th><th>jobs</th><th>wait median</th><th>wait max</th>
<th>start-up median</th><th>node-h</th><th>GPU-h</th><th>ended by</th></tr>{rows}</table>
<div class="legend">{legend}</div>
<div id="timeline">{_timeline(data)}</div>
<ul class="notes">{notes}</ul>
</body></html>
"""
