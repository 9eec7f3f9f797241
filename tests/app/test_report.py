"""`colossal train --report` and `colossal report`: the page is rendered by Debian's Chromium
(headless, the DOM dumped after its scripts ran, console errors on stderr) and must hold one
plot per recorded metric whose path has exactly one point per step, each mapping back to the
metrics file's value; the summary and configuration are there; nothing is fetched from the
network. Bad metrics files and run folders are named errors (exit 2). Chromium missing is a
failure, not a skip: `make test` installs it (scripts/setup.sh)."""
import html.parser
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from train_helpers import BIN, make_work  # noqa: E402

STEPS = 8
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def colossal(args, cwd=None, ok=True):
    p = subprocess.run([BIN] + args, capture_output=True, text=True, timeout=120, env=ENV, cwd=cwd)
    if ok:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def refused(args, *needles):
    p = colossal(args, ok=False)
    assert p.returncode == 2, f"exit {p.returncode}, expected 2 (a named input error):\n{p.stderr[-3000:]}"
    for n in needles:
        assert n in p.stderr, f"{n!r} not in:\n{p.stderr[-3000:]}"
    assert "terminate called" not in p.stderr and "Traceback" not in p.stderr


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A short CPU run with --metrics_file, --save_dir and --report."""
    work = make_work(tmp_path_factory.mktemp("report"))
    p = colossal(["train", "--model", str(work / "model.json"), "--data", str(work / "tokens.bin"),
                  "--plugin", "none", "--seq_len", "16", "--micro_batch", "2", "--steps", str(STEPS),
                  "--lr", "3e-3", "--warmup", "2", "--save_dir", str(work / "ckpt"), "--save_every", "4",
                  "--metrics_file", str(work / "metrics.jsonl"), "--report"])
    report = work / "ckpt" / "report.html"
    assert f"report: {report}" in p.stderr, p.stderr[-2000:]
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return work, rows


def chromium():
    exe = shutil.which("chromium")
    assert exe, "chromium is not installed (scripts/setup.sh installs it: make test runs it)"
    return exe


def render(page, tmp_path):
    """The DOM after the page's scripts ran, and Chromium's stderr (console messages)."""
    p = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        f"--user-data-dir={tmp_path / 'chromium-profile'}", "--enable-logging=stderr",
                        "--v=0", "--dump-dom", page.resolve().as_uri()],
                       capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout, p.stderr


def console_errors(stderr):
    return [line for line in stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]


class Dom(html.parser.HTMLParser):
    """The <svg class="chart"> elements with their <path> series, and each table row as [table id,
    cell texts...]."""

    def __init__(self):
        super().__init__()
        self.charts, self.body, self.cells, self.rows, self.ids = {}, {}, None, [], set()
        self.readouts, self._readout, self.notes, self._note = [], False, "", False
        self._chart = self._table = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "body":
            self.body = a
        elif tag == "svg" and a.get("class") == "chart":
            self._chart = a["id"]
            self.charts[self._chart] = dict(a, paths=[], alone=[])
        elif tag == "path" and self._chart:
            self.charts[self._chart]["paths"].append(a)
        elif tag == "circle" and self._chart and a.get("class") == "alone":
            self.charts[self._chart]["alone"].append(a)
        elif tag == "div" and a.get("class") == "readout":
            self._readout = True
            self.readouts.append("")
        elif tag == "p" and a.get("id") == "missing":
            self._note = True
        elif tag == "table":
            self._table = a.get("id")
        elif tag == "tr":
            self.cells = [self._table]

    def handle_endtag(self, tag):
        if tag == "div":
            self._readout = False
        elif tag == "p":
            self._note = False
        if tag == "svg":
            self._chart = self._table = None
        elif tag == "tr" and self.cells is not None:
            self.rows.append(self.cells)
            self.cells = None

    def handle_data(self, data):
        if self._readout:
            self.readouts[-1] += data
        if self._note:
            self.notes += data
        if self.cells is not None and data.strip():
            self.cells.append(data.strip())


def points(d):
    """[(x, y)] of an SVG path made of M/L commands; asserts nothing else is in it."""
    cmds = re.findall(r"([ML])(-?[\d.]+),(-?[\d.]+)", d)
    assert "".join(f"{c}{x},{y}" for c, x, y in cmds) == d, d
    return [(float(x), float(y)) for _, x, y in cmds]


def check_chart(chart, key, rows, log=False):
    """The path of `key`: one point per row with a value (null: not finite, no point), at (step,
    value) in the chart's own scale. Returns the path's `d`."""
    rows = [r for r in rows if r[key] is not None]
    f = {k: float(chart[f"data-{k}"]) for k in ("x0", "x1", "y0", "y1", "px0", "px1", "py0", "py1")}
    assert chart["data-yscale"] == ("log" if log else "linear")
    (path,) = [p for p in chart["paths"] if p.get("data-key") == key]
    pts = points(path["d"])
    assert int(path["data-points"]) == len(pts) == len(rows), (key, len(pts), len(rows))
    scale = float(path["data-scale"])
    # Coordinates are printed with two decimals: half a hundredth of a pixel, in data units.
    tol_y = abs(f["y1"] - f["y0"]) / abs(f["py1"] - f["py0"]) * 0.0051
    tol_x = abs(f["x1"] - f["x0"]) / abs(f["px1"] - f["px0"]) * 0.0051
    for (x, y), r in zip(pts, rows):
        step = f["x0"] + (x - f["px0"]) / (f["px1"] - f["px0"]) * (f["x1"] - f["x0"])
        value = f["y0"] + (y - f["py0"]) / (f["py1"] - f["py0"]) * (f["y1"] - f["y0"])
        assert abs(step - r["step"]) <= tol_x, (key, step, r["step"])
        want = math.log10(r[key] * scale) if log else r[key] * scale
        assert abs(value - want) <= tol_y, (key, r["step"], value, want)
    # The axes span the data: the extremes are drawn at the edges of the box.
    vals = [math.log10(r[key] * scale) if log else r[key] * scale for r in rows]
    assert min(vals) == pytest.approx(f["y0"]) or max(vals) == pytest.approx(f["y1"])
    return path["d"]


def summary(dom):
    return {r[1]: r[2:] for r in dom.rows if r[0] == "summary"}


def test_train_report_in_browser(run, tmp_path):
    work, rows = run
    page = work / "ckpt" / "report.html"
    text = page.read_text()
    # Self-contained: no element loads anything; the only URL is the SVG namespace.
    assert not re.search(r"\b(src|href)\s*=", text) and "@import" not in text
    assert set(re.findall(r"https?://[^\s'\"]+", text)) == {"http://www.w3.org/2000/svg"}

    dom_text, stderr = render(page, tmp_path)
    assert not console_errors(stderr), console_errors(stderr)
    dom = Dom()
    dom.feed(dom_text)
    assert dom.body.get("data-rendered") == "ok", "the page's script did not run to its end"
    # fp32 on CPU: no loss scale (it stays 1), no device memory.
    assert set(dom.charts) == {"plot-loss", "plot-lr", "plot-grad_norm", "plot-tok_s", "plot-memory"}
    for key in ("loss", "lr", "grad_norm", "tok_s"):
        check_chart(dom.charts[f"plot-{key}"], key, rows)
    assert [p["data-key"] for p in dom.charts["plot-memory"]["paths"]] == ["host_rss_bytes"]
    check_chart(dom.charts["plot-memory"], "host_rss_bytes", rows)
    assert "log-loss" in dom.ids  # the loss plot's log-scale toggle
    assert dom.notes == "Constant (not an fp16 run), not plotted: Loss scale (fp16).", dom.notes

    # The log-scale toggle and the hover readout, driven by a script appended to a copy of the
    # page: a click on the checkbox, then the mouse at the right edge of the loss plot.
    driven = tmp_path / "driven.html"
    driven.write_text(text.replace("</body>", """<script>
document.getElementById('log-loss').click();
var svg = document.getElementById('plot-loss'), r = svg.getBoundingClientRect();
svg.dispatchEvent(new MouseEvent('mousemove', {clientX: r.right - 1, clientY: r.top + 20}));
</script></body>"""))
    dom_text2, stderr2 = render(driven, tmp_path)
    assert not console_errors(stderr2), console_errors(stderr2)
    dom2 = Dom()
    dom2.feed(dom_text2)
    check_chart(dom2.charts["plot-loss"], "loss", rows, log=True)
    shown = repr(float("%.4g" % rows[-1]["loss"]))  # the page's 4 significant digits
    assert dom2.readouts[0] == f"step {STEPS}   loss {shown}", dom2.readouts

    table = summary(dom)
    assert table["final loss"] == [f"{rows[-1]['loss']:.5g}"], table
    assert table["steps"][0].startswith(f"{STEPS} of {STEPS}"), table
    assert table["plugin"] == ["none, fp32, 1 rank(s)"], table
    assert table["model"][0].endswith(", 98.6 K parameters"), table  # counted from model.json
    assert ["config", "[optim]"] in dom.rows and ["config", "lr", "0.003"] in dom.rows, dom.rows


def test_report_command(run, tmp_path):
    """`colossal report RUN_DIR` from another folder finds the metrics file through the
    checkpoint (an absolute path) and writes the same plots; --metrics alone works too."""
    work, rows = run
    out = tmp_path / "r.html"
    p = colossal(["report", str(work / "ckpt"), "--out", str(out)], cwd=tmp_path)
    assert p.stdout.strip() == str(out)
    dom_text, stderr = render(out, tmp_path)
    assert not console_errors(stderr), console_errors(stderr)
    dom = Dom()
    dom.feed(dom_text)
    check_chart(dom.charts["plot-loss"], "loss", rows)
    # A step folder of the run works as RUN_DIR.
    colossal(["report", str(work / "ckpt" / "step-00000004"), "--out", str(tmp_path / "s.html")])
    # No run folder: the metrics file alone (no configuration), report.html next to it.
    metrics = tmp_path / "m" / "metrics.jsonl"
    metrics.parent.mkdir()
    shutil.copy(work / "metrics.jsonl", metrics)
    p = colossal(["report", "--metrics", str(metrics)])
    assert p.stdout.strip() == str(metrics.parent / "report.html")
    assert "No recorded configuration" in (metrics.parent / "report.html").read_text()


def test_fp16_cuda_like_metrics(tmp_path):
    """What a CPU run does not record: a moving loss scale (fp16), device memory, a skipped step
    with a non-finite loss (null in the file: a gap in the line, not a point at 0); and a resume
    after step 2 whose first step took longer than the whole first process (0.25 s steps, then
    0.6 s steps): the wall time is 0.5 + 6.01 s."""
    rows = []
    for i in range(1, 13):
        step_s, elapsed = (0.25, 0.25 * i) if i <= 2 else (0.6, 0.61 + 0.6 * (i - 3))
        rows.append({"step": i, "loss": 5.0 - 0.25 * i, "lr": 1e-3, "grad_norm": 1.0 / i, "tokens": 64 * i,
                     "tok_s": 64 / step_s, "elapsed_s": elapsed, "skipped": i == 5,
                     "loss_scale": 65536.0 if i < 5 else 32768.0, "host_rss_bytes": (2 + i / 10) * 2**30,
                     "device_allocated_bytes": 3 * 2**30, "device_peak_allocated_bytes": (5 + i / 20) * 2**30})
    rows[4]["loss"] = rows[4]["grad_norm"] = rows[6]["loss"] = None
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    colossal(["report", "--metrics", str(metrics), "--out", str(tmp_path / "r.html")])
    dom_text, stderr = render(tmp_path / "r.html", tmp_path)
    assert not console_errors(stderr), console_errors(stderr)
    dom = Dom()
    dom.feed(dom_text)
    assert dom.body.get("data-rendered") == "ok"
    assert set(dom.charts) == {"plot-loss", "plot-lr", "plot-grad_norm", "plot-tok_s", "plot-memory",
                               "plot-loss_scale"}
    d = check_chart(dom.charts["plot-loss"], "loss", rows)
    # The line breaks at each non-finite step; step 6, alone between two, is a dot.
    assert d.count("M") == 3, d
    (dot,) = dom.charts["plot-loss"]["alone"]
    assert f"M{float(dot['cx']):.2f},{float(dot['cy']):.2f}M" in d, (dot, d)
    check_chart(dom.charts["plot-loss_scale"], "loss_scale", rows)
    keys = [p["data-key"] for p in dom.charts["plot-memory"]["paths"]]
    assert keys == ["device_peak_allocated_bytes", "device_allocated_bytes", "host_rss_bytes"]
    for key in ("device_peak_allocated_bytes", "host_rss_bytes"):
        check_chart(dom.charts["plot-memory"], key, rows)
    table = summary(dom)
    assert table["skipped steps"] == ["1 (non-finite gradients)"], table
    assert table["peak device memory (allocated)"] == ["5.60 GiB"], table
    assert table["wall time"] == ["6.5 s"], table


def test_resumed_run(run, tmp_path):
    """A run resumed from step 4 (after a crash that left steps 5-8 of an earlier attempt in the
    metrics file): one series of 8 steps, and the wall time adds up both processes' stretches."""
    work, rows = run
    shutil.copytree(work / "ckpt", tmp_path / "ckpt")
    metrics = tmp_path / "metrics.jsonl"
    shutil.copy(work / "metrics.jsonl", metrics)
    p = colossal(["train", "--model", str(work / "model.json"), "--data", str(work / "tokens.bin"),
                  "--plugin", "none", "--seq_len", "16", "--micro_batch", "2", "--steps", str(STEPS),
                  "--lr", "3e-3", "--warmup", "2", "--save_dir", str(tmp_path / "ckpt"),
                  "--resume", str(tmp_path / "ckpt" / "step-00000004"), "--metrics_file", str(metrics), "--report"])
    assert "dropped 4 line(s) after step 4" in p.stderr, p.stderr[-2000:]
    resumed = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]  # fp32 on CPU: exact resume
    page = (tmp_path / "ckpt" / "report.html").read_text()
    data = json.loads(re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page).group(1))
    assert [r["step"] for r in data["rows"]] == list(range(1, STEPS + 1))
    wall = resumed[3]["elapsed_s"] + resumed[-1]["elapsed_s"]
    assert f"<th>wall time</th><td>{wall:.1f} s</td>" in page
    # --overwrite deletes the old run's report with its checkpoints.
    colossal(["train", "--model", str(work / "model.json"), "--data", str(work / "tokens.bin"), "--plugin", "none",
              "--seq_len", "16", "--steps", "1", "--save_dir", str(tmp_path / "ckpt"), "--overwrite"])
    assert not (tmp_path / "ckpt" / "report.html").exists()


def test_broken_page_is_caught(tmp_path):
    """The harness itself: a script error in a page shows up in Chromium's stderr."""
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><script>undefinedFunction();</script></body></html>")
    _, stderr = render(page, tmp_path)
    assert any("Uncaught" in line for line in console_errors(stderr)), stderr[-2000:]


def test_bad_inputs(run, tmp_path):
    work, rows = run
    good = (work / "metrics.jsonl").read_text().splitlines()
    cases = []
    missing = tmp_path / "none.jsonl"
    cases.append((["report", "--metrics", str(missing)], [f"metrics file {missing} does not exist"]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases.append((["report", "--metrics", str(empty)], [f"metrics file {empty} is empty: no steps recorded"]))
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text("\n".join(good[:2] + [good[2][:17]] + good[3:]) + "\n")
    cases.append((["report", "--metrics", str(corrupt)], [f"metrics file {corrupt} line 3 is not a JSON object"]))
    twice = tmp_path / "twice.jsonl"
    twice.write_text("\n".join(good + good[:1]) + "\n")
    cases.append((["report", "--metrics", str(twice)], [f"line {len(good) + 1}: step 1 after step {len(good)}"]))
    no_step = tmp_path / "no_step.jsonl"
    no_step.write_text(good[0] + "\n" + '{"loss": 1.0}\n')
    cases.append((["report", "--metrics", str(no_step)], [f"metrics file {no_step} line 2 has no integral \"step\""]))
    cases.append((["report", str(tmp_path / "nowhere")], [f"run folder {tmp_path / 'nowhere'} does not exist"]))
    cases.append((["report", str(tmp_path)], [f"run folder {tmp_path} holds no checkpoint", "--metrics FILE"]))
    cases.append((["report"], ["needs a RUN_DIR (a --save_dir) or --metrics FILE"]))
    cases.append((["report", "--metrics", str(work / "metrics.jsonl"), "--out", str(tmp_path / "no" / "r.html")],
                  [f"folder {tmp_path / 'no'} does not exist"]))
    cases.append((["train", "--model", str(work / "model.json"), "--data", str(work / "tokens.bin"), "--steps", "1",
                   "--report"], ["option 'report' needs 'metrics_file'"]))
    # Each case is mostly the binary's start-up (loading LibTorch): run them side by side.
    with ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(refused, args, *needles) for args, needles in cases]:
            f.result()
    assert not (tmp_path / "report.html").exists()
