"""`colossal schedule` end to end: the printed 1F1B bubble equals the analytic (S-1)/(M+S-1),
zero-bubble styles print a smaller one, tables written with --csv/--json load back through
--table with the same result, the SVG parses as XML, and bad input exits with code 2 naming the
value."""
import os
import re
import subprocess
import xml.etree.ElementTree as ET
from fractions import Fraction

BIN = os.environ["COLOSSAL_BIN"]


def run(*args, ok=True):
    p = subprocess.run([BIN, "schedule", *args], capture_output=True, text=True, timeout=60)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def field(out, name):
    m = re.search(rf"^{name}\s+([0-9.eE+-]+)", out, re.M)
    assert m, out
    return float(m.group(1))


def test_1f1b_bubble_is_analytic():
    for s, m in [(4, 8), (2, 2), (8, 13), (3, 30)]:
        out = run("--pp", str(s), "--num_microbatches", str(m)).stdout
        assert abs(field(out, "bubble") - float(Fraction(s - 1, m + s - 1))) < 1e-6, out
        assert abs(field(out, "step time") - 3 * (m + s - 1)) < 1e-9, out
    out = run("--pp", "4", "--num_microbatches", "8").stdout
    assert "0.272727" in out  # 3/11
    assert "analytic (S-1)/(M+S-1) = 3/11" in out
    # Megatron's bound: stage r holds min(S - r, M) micro-batches.
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+([0-9.]+)$", out, re.M)
    assert [(int(r), int(p)) for r, p, _ in rows] == [(0, 4), (1, 3), (2, 2), (3, 1)]
    assert all(float(b) == 24 for _, _, b in rows)


def test_zero_bubble_styles_beat_1f1b():
    one = field(run("--pp", "4", "--num_microbatches", "8").stdout, "bubble")
    zbh1 = field(run("--pp", "4", "--num_microbatches", "8", "--pp_style", "zbh1").stdout, "bubble")
    zbv = field(run("--pp", "4", "--num_microbatches", "8", "--pp_style", "zbv").stdout, "bubble")
    assert zbh1 < one and zbv < one, (one, zbh1, zbv)
    # ZB-H1's bubble (S-1)(f+b-w) with f = b = w: 3 / (3 * 8 + 3).
    assert zbh1 <= 3 / 27 + 1e-9


def test_tables_round_trip_through_the_cli(tmp_path):
    csv, js, svg, html = (tmp_path / n for n in ("s.csv", "s.json", "s.svg", "s.html"))
    base = run("--pp", "4", "--num_microbatches", "8", "--pp_style", "interleaved", "--print",
               "--csv", str(csv), "--json", str(js), "--svg", str(svg), "--html", str(html),
               "--f_cost", "1", "--b_cost", "2", "--w_cost", "0", "--comm_cost", "0.1").stdout
    assert "rank 3:" in base and "SendF" in base
    for table in (csv, js):
        out = run("--table", str(table), "--f_cost", "1", "--b_cost", "2", "--w_cost", "0",
                  "--comm_cost", "0.1").stdout
        assert field(out, "bubble") == field(base, "bubble")
        assert field(out, "step time") == field(base, "step time")
    root = ET.parse(svg).getroot()
    rects = [e for e in root.iter() if e.tag.endswith("rect")]
    assert len(rects) == 4 * 8 * 2 * 2  # F and BW of every (micro-batch, chunk) on every rank
    assert "<svg" in html.read_text()


def test_bad_input_exits_2():
    cases = [
        (["--pp", "4", "--num_microbatches", "2"], "microbatches (2) must be >= stages (4)"),
        (["--pp_style", "zbv", "--chunks", "3"], "zbv needs chunks"),
        (["--pp_style", "interleaved", "--chunks", "1"], "interleaved needs chunks"),
        (["--pp_style", "pipedream"], "pipedream"),
        (["--pp", "0"], "pp_size"),
        (["--f_cost", "-1"], "f_cost"),
        (["--table", "/nonexistent.csv"], "/nonexistent.csv"),
        (["--table", "x.csv", "--pp", "2"], "--pp_size comes from the table"),
    ]
    for args, fragment in cases:
        p = run(*args, ok=False)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert fragment in p.stderr, (args, p.stderr)


def test_bad_table_names_the_line(tmp_path):
    t = tmp_path / "bad.csv"
    t.write_text("# stages=2 microbatches=1\nrank,op,mb,chunk\n0,F,0,0\n0,Fw,0,0\n")
    p = run("--table", str(t), ok=False)
    assert p.returncode == 2 and f"{t} line 4" in p.stderr, p.stderr
