"""Issue 31 item 3: `ray-slurm report --html`'s page in a real browser (headless Chromium),
from recorded records of a burst, without Slurm: one bar per job with its end, the totals
above, nothing fetched. The same page of a real run (the sandbox, after `ray down`):
tests/e2e/test_ray_up.py."""

from __future__ import annotations

import os
from pathlib import Path

from ray_slurm_provider.cli.report import build
from ray_slurm_provider.cli.report_html import render
from ray_slurm_provider.provider.history import Event, History
from ray_slurm_provider.slurm.sacct import Usage
from tests.e2e import browser
from tests.fakes import FakeSlurm
from tests.unit.test_cmds import cluster
from tests.unit.test_report import T0, FakeAccounting

#: (job, type, kind, submitted, started, Ray up, ended, cancelled by, Slurm's final state)
BURST = [("100", "head", "head", 0, 4, 19, 900, "ray down", "CANCELLED"),
         *[(str(101 + i), "cpu_worker", "worker", 60, 62 + 3 * i, 75 + 3 * i,
            400 + 20 * i, "autoscaler", "CANCELLED") for i in range(8)],
         ("109", "cpu_worker", "worker", 60, 90, 104, 300, "", "CANCELLED"),
         ("110", "cpu_worker", "worker", 60, 95, 110, 500, "", "PREEMPTED"),
         ("111", "gpu_worker", "worker", 120, 250, 266, 880, "ray down", "CANCELLED"),
         ("112", "gpu_worker", "worker", 120, 260, None, 320, "", "FAILED"),
         ("113", "gpu_worker", "worker", 120, None, None, 700, "autoscaler", "CANCELLED")]


def write_burst(h: History) -> str:
    run = h.start_run(T0)
    events = []
    for job, node_type, kind, sub, start, up, end, by, _ in BURST:
        gpus = 1 if node_type == "gpu_worker" else 0
        events.append(Event("submitted", T0 + sub, job=job, type=node_type, kind=kind, nodes=1,
                            cpus=2, gpus=gpus))
        if start is not None:
            events.append(Event("listed", T0 + start, job=job, type=node_type, kind=kind,
                                state="RUNNING"))
        if up is not None:
            events.append(Event("ray_up", T0 + up, job=job))
        if by:
            events.append(Event("cancel", T0 + end - 1, job=job, by=by))
        events.append(Event("gone", T0 + end, job=job))
    h.append(events, run)
    return run


def test_the_page_in_a_browser(tmp_path: Path) -> None:
    c = cluster(tmp_path, FakeSlurm())
    write_burst(History(c.cdir.root))
    acct = FakeAccounting([Usage(j[0], j[8], "", "", {"billing": "2"}) for j in BURST])
    data = build(c, None, now=lambda: T0 + 1000, acct=acct)  # type: ignore[arg-type]
    html = tmp_path / "report.html"
    html.write_text(render(data))
    ends = {j["job"]: j["end"] for j in data["jobs"]}
    assert ends["109"] == "scancel" and ends["110"] == "preemption" and ends["112"] == "failure"
    with browser.page(html) as page:
        bars = page.find_elements("css selector", "g.job")
        assert {b.get_attribute("data-job"): b.get_attribute("data-end") for b in bars} == ends
        # Each bar's parts: never started -> queued only; started, not up -> no "up" part.
        parts = {b.get_attribute("data-job"): {r.get_attribute("class") for r in
                                               b.find_elements("css selector", "rect")}
                 for b in bars}
        assert parts["113"] == {"queued"} and parts["112"] == {"queued", "starting"}
        assert parts["101"] == {"queued", "starting", "up"}
        assert page.find_element("css selector", "#totals .card b").text == str(len(BURST))
        assert browser.network_entries(page) == []
        shot = tmp_path / "report.png"
        browser.full_screenshot(page, shot)
        assert shot.stat().st_size > 10_000
        keep = os.environ.get("RSP_REPORT_PAGE_SCREENSHOT")
        if keep:
            Path(keep).write_bytes(shot.read_bytes())
