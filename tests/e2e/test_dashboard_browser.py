"""One job's page in a real headless Chromium against a real server with a real (tiny) tuning job, and the
figures' buttons laid out by the browser."""

from __future__ import annotations

import os
import re
import shutil
import signal
import struct
import subprocess
import time
from pathlib import Path

import httpx
import plotly
import pytest

from sltune.dashboards import figures
from sltune.settings import Settings
from tests.support.dashboard_data import realistic_trials
from tests.support.servers import Proc, TOKEN, free_port
from tests.support.specs import tiny_spec


# -- a real browser against a real server ------------------------------------------------------------
def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


def run_chromium(binary: str, profile: Path, *args: str, timeout: float = 90) -> str:
    """Headless Chromium with no network beyond the loopback server: no sync, updates or first-run."""
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
           "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--disable-extensions", "--hide-scrollbars",
           "--mute-audio", f"--user-data-dir={profile}", "--virtual-time-budget=15000", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "HOME": str(profile)})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A real (tiny, profiled) tuning job in a SQLite store, and a real `sltune serve` reading it: (chromium, the
    server's URL, the job's id)."""
    binary = chromium()
    if binary is None:
        pytest.skip("no chromium binary: install chromium (apt-get install -y chromium) to run the browser test")
    from sltune.service.local import tune

    tmp = tmp_path_factory.mktemp("served")
    db, data = f"sqlite:///{tmp / 'jobs.db'}", tmp / "data"
    port = free_port()
    env = {**os.environ, "SLTUNE_API_TOKEN": TOKEN, "SLTUNE_DATA_DIR": str(data)}
    server = Proc(["serve", "--port", str(port), "--no-worker", "--db", db], env, tmp / "serve.log")
    try:
        # the job runs here while the server starts; the server only reads the same database
        out = tune(tiny_spec("browser-check", trials=4, profile=True), db=db, settings=Settings(data_dir=data))
        assert out["status"] == "succeeded", out
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up:\n" + server.output()
            time.sleep(0.2)
        yield binary, url, out["job_id"]
    finally:
        server.kill(signal.SIGTERM)


@pytest.mark.slow
def test_job_page_renders_its_plots_in_headless_chromium(served, tmp_path):
    binary, url, job_id = served
    trials = httpx.get(f"{url}/jobs/{job_id}/trials").json()
    ok = [t for t in trials if t["status"] == "ok" and (t["result"] or {}).get("breakdown")]
    assert ok and httpx.get(url + ok[0]["trace_url"]).status_code == 200

    page = f"{url}/dashboard/jobs/{job_id}"
    dom = run_chromium(binary, tmp_path / "chromium", "--dump-dom", page)
    plots = dom.count("js-plotly-plot")            # the class plotly.js adds once it has drawn a figure
    pielayers = dom.count('class="pielayer"')
    slices = len(re.findall(r'<g class="slice"', dom))
    points = len(re.findall(r'<path class="point"', dom))
    bars = len(re.findall(r'<g class="point"', dom))
    print(f"\nDOM of {page}: {plots} .js-plotly-plot, {pielayers} .pielayer, "
          f"{slices} g.slice, {points} scatter points, {bars} bars")
    importance = httpx.get(page).text.count('class="plotly-graph-div"') == 8
    # history, importance, parallel coordinates, throughput, peaks, breakdown pies, seconds, timeline
    assert plots == 8 and importance, dom[-3000:]
    assert dom.count('class="parcoords"') == 1                    # parallel coordinates drawn
    assert dom.count('class="updatemenu-button"') >= 6            # log-y toggles: history, throughput, seconds
    assert slices >= 4 * min(len(ok), figures.PIE_LIMIT)          # compute, memcpy, CPU, other at least
    assert "all-gather" not in dom.split("Time breakdown per trial")[1]   # one rank: no empty slices
    assert points >= len(ok) and bars >= len(trials) + len(ok)    # timeline bars, stacked seconds
    assert "<table id=\"trials\">" in dom and dom.count("sltuneSort(this)") == 14   # a sortable heading per column
    assert "browser-check" in dom and f"/jobs/{job_id}/config.yaml" in dom

    # the table sorts and filters in the browser: ok trials with b=2 whose backend column says speedloader (a
    # column=value word matches that column's cell), by tokens/s
    view = run_chromium(binary, tmp_path / "chromium", "--dump-dom",
                        f"{page}?filter=ok+b%3D2+backend%3Dspeedloader&sort=tokens/s")
    body = view.split('<table id="trials">')[1].split("</table>")[0]
    rows = re.findall(r"<tr( hidden=\"\")?>(.*?)</tr>", body.split("<tbody>")[1])
    shown = [re.findall(r"<td class=\"num\" data-v=\"([^\"]*)\"", cells)[0] for hidden, cells in rows if not hidden]
    expect = sorted(t["result"]["tokens_per_s"] for t in ok if t["config"]["sub_batch_size"] == 2)
    assert expect and [float(v) for v in shown] == expect and len(rows) == len(trials)
    assert f">{len(expect)}</span> of {len(trials)} trials" in view

    shot = tmp_path / "dashboard-job.png"
    run_chromium(binary, tmp_path / "chromium", f"--screenshot={shot}", "--window-size=1400,4800", page)
    width, height = png_size(shot)
    assert (width, height) == (1400, 4800) and shot.stat().st_size > 50_000
    print(f"screenshot of the job page: {shot}")
    keep = os.environ.get("SLTUNE_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / shot.name)


@pytest.mark.slow
def test_a_click_on_a_plotted_trial_or_its_table_row_opens_the_trials_page(served, tmp_path):
    """Issue #46: the job page linked no trial. A user's clicks (mouse events at the point on the page) on a point of
    the history, on a pie and on a row of the trials table each open that trial's page, which draws its figures and
    serves its trace."""
    from tests.support.cdp import Browser

    binary, url, job_id = served
    page = f"{url}/dashboard/jobs/{job_id}"
    browser = Browser(binary, tmp_path / "chromium")
    try:
        def at(selector: str, on_it: bool = False) -> dict:
            """The centre of the element, scrolled into view, in the viewport's coordinates. `on_it`: a point where the
            element itself is under the mouse (a pie's slice: the centre of its box can be in the donut's hole), the
            first of a grid over its box, as a user aims at the slice they see."""
            return browser.evaluate(f"""(() => {{ const e = document.querySelector({selector!r});
                e.scrollIntoView({{block: "center"}}); const r = e.getBoundingClientRect();
                for (let i = 1; {'true' if on_it else 'false'} && i < 10; i++) for (let j = 1; j < 10; j++) {{
                    const x = r.left + r.width * i / 10, y = r.top + r.height * j / 10;
                    if (document.elementFromPoint(x, y) === e) return {{x, y}}; }}
                return {{x: r.left + r.width / 2, y: r.top + r.height / 2}}; }})()""")

        def hovering(figure: str) -> str:
            """True once Plotly has found the point under the mouse in the figure's plot: its hover label is drawn."""
            return f"!!document.querySelector({(figure + ' .hoverlayer .hovertext')!r})"

        def opened(n: int) -> None:
            browser.wait_for("Page.loadEventFired", timeout=30)
            assert browser.evaluate("location.pathname") == f"/dashboard/jobs/{job_id}/trials/{n}"
            assert browser.evaluate("document.querySelector('h1').textContent").startswith(f"Trial #{n} ")

        # a point of the history: its x is its trial's number
        browser.open(page)
        assert browser.wait_until("document.querySelectorAll('.js-plotly-plot').length") == 8
        point = "h2#history + .fig .scatterlayer path.point"
        n = browser.evaluate(f"document.querySelector({point!r}).__data__.x")
        browser.click(lambda: at(point), hovered=hovering("h2#history + .fig"))
        opened(n)
        # the trial's page: its steps and its pie drawn, its trace served as JSON
        assert browser.wait_until("document.querySelectorAll('.js-plotly-plot').length") == 2
        for heading in ("Config", "Throughput", "Measured and predicted", "Time breakdown", "Top operators", "Parity",
                        "Trace"):
            assert browser.evaluate(f"!!document.getElementById({heading.lower().replace(' ', '-')!r})"), heading
        trace = browser.evaluate("document.querySelector('#trace ~ p a[download]').href")
        assert trace == f"{url}/jobs/{job_id}/trials/{n}/trace"
        assert "traceEvents" in httpx.get(trace).json()

        # a pie of the breakdown: the first pie is the trace that names its trial
        browser.open(page)
        browser.wait_until("document.querySelectorAll('.js-plotly-plot').length == 8")
        pie = "h2#time-breakdown-per-trial ~ .fig g.slice path"
        n = browser.evaluate("document.querySelector('h2#time-breakdown-per-trial ~ .fig .plotly-graph-div')"
                             ".data[0].meta.trial")
        browser.click(lambda: at(pie, on_it=True), hovered=hovering("h2#time-breakdown-per-trial ~ .fig"))
        opened(n)

        # the last row of the trials table
        browser.open(page)
        trials = httpx.get(f"{url}/jobs/{job_id}/trials").json()
        last = trials[-1]["number"]
        browser.click(lambda: at(f"#trials a[href='/dashboard/jobs/{job_id}/trials/{last}']"))
        opened(last)
    finally:
        browser.close()


MEASURE_JS = """<script>
setTimeout(() => {
  const box = el => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const out = [...document.querySelectorAll(".js-plotly-plot")].map(div => ({
    modebar: [...div.querySelectorAll(".modebar")].map(box),
    buttons: [...div.querySelectorAll(".updatemenu-button")].map(box),
    titles: [...div.querySelectorAll(".annotation")].map(box)}));
  const pre = document.createElement("pre"); pre.id = "geometry"; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}, 1000);
</script>"""


@pytest.mark.slow
def test_the_log_y_buttons_stay_clear_of_plotlys_mode_bar_in_a_browser(tmp_path):
    """Issue #23: the "linear y / log y" buttons sat under Plotly's mode bar. Every figure that has them is
    drawn as the job page draws it, in headless Chromium, and the boxes the browser laid out must not meet
    (neither the mode bar nor the subplot titles)."""
    import json

    from sltune.dashboards.pages import fig_html

    binary = chromium()
    if binary is None:
        pytest.skip("no chromium binary: install chromium (apt-get install -y chromium) to run the browser test")
    trials = realistic_trials()
    figs = [figures.history_figure(trials), figures.throughput_figure(trials, 8), figures.seconds_figure(trials)]
    js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    page = tmp_path / "figures.html"
    page.write_text(f'<!doctype html><html><head><meta charset="utf-8"><script src="{js.as_uri()}"></script></head>'
                    f'<body><main style="max-width:1400px">{"".join(fig_html(f, "") for f in figs)}</main>'
                    f"{MEASURE_JS}</body></html>")
    dom = run_chromium(binary, tmp_path / "chromium", "--window-size=1000,1600", "--dump-dom", page.as_uri())
    drawn = json.loads(re.search(r'<pre id="geometry">(.*?)</pre>', dom).group(1))
    assert len(drawn) == 3

    def meet(a, b) -> bool:
        return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]

    for fig in drawn:
        assert len(fig["buttons"]) == 2 and len(fig["modebar"]) == 1, fig
        for button in fig["buttons"]:
            assert not any(meet(button, other) for other in fig["modebar"] + fig["titles"]), fig
