"""bench_kernels --timing_log and scripts/attn_clocks.py (issue 25's clock and power readings).

The log must hold one line per timing, in table order, each row's printed median the median of
its line's reps; attn_clocks.py must match rows to their windows, take only the samples inside
each window, and refuse a log that does not belong to the table."""
import datetime
import os
import re
import subprocess
import sys

import pytest

BUILD = os.environ["COLOSSAL_BUILD_DIR"]
SRC = os.environ["COLOSSAL_SOURCE_DIR"]
BENCH = os.path.join(BUILD, "bench", "bench_kernels")
CLOCKS = os.path.join(SRC, "scripts", "attn_clocks.py")


def test_timing_log_has_one_line_per_timing_in_row_order(tmp_path):
    log = tmp_path / "timing.log"
    p = subprocess.run([BENCH, "--cpu", "--rows", "--reps", "3", "--warmup", "1", "--timing_log",
                        str(log)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = [l.split() for l in log.read_text().splitlines()]
    medians = []
    for l in lines:
        start, end, reps = float(l[0]), float(l[1]), [float(x) for x in l[2:]]
        assert len(reps) == 3 and start <= end and all(r > 0 for r in reps), l
        medians.append(sorted(reps)[1])
    # The table's timed values (fused, then aten where there is one), after the two ceilings.
    table = []
    for row in p.stdout.splitlines():
        m = re.match(r"(rms_norm|rotary|swiglu|fused_adamw)\s.*?\s(fwd|bwd|step)\s+([\d.]+)\s+([\d.-]+)",
                     row)
        if m:
            table.append(float(m.group(3)))
            if m.group(4) != "-":
                table.append(float(m.group(4)))
    assert len(table) >= 6
    assert len(lines) == len(table) + 2, (len(lines), len(table))
    for printed, logged in zip(table, medians[2:]):
        assert abs(printed - logged) <= 0.0006, (printed, logged)


def test_timing_log_that_cannot_be_written_is_an_error(tmp_path):
    p = subprocess.run([BENCH, "--cpu", "--rows", "--reps", "1", "--warmup", "0", "--timing_log",
                        str(tmp_path / "no" / "such" / "dir" / "t.log")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert "cannot append to --timing_log" in p.stderr


TABLE = """attention   W2 own dense pingpong+dq_tma B4 h32/32 S4096 D128             fwd+bwd      4.382          -       -       337     42%
attention   W2 own dense pingpong+dq_tma alt. B4 h32/32 S4096 D128             fwd+bwd      4.221          -       -       337     42%
attention   W2 sdpa cudnn alt.       B4 h32/32 S4096 D128           fwd+bwd      4.044          -       -       369     46%
attention   W2 sdpa flash            B4 h32/32 S4096 D128           fwd         -1.000          -       -         -      -  not available: x
"""


def write_case(tmp_path, t0, medians):
    (tmp_path / "bench.log").write_text("ceilings: ...\n" + TABLE)
    # One ceiling timing first, then one line per timed row: windows of one second each.
    with open(tmp_path / "timing.log", "w") as f:
        f.write(f"{t0 - 5:.3f} {t0 - 4:.3f} 0.1\n")
        for i, m in enumerate(medians):
            f.write(f"{t0 + i:.3f} {t0 + i + 0.95:.3f} {m + 0.1:.4f} {m:.4f} {m - 0.1:.4f}\n")
    # Samples every 0.1 s, in UTC as nvidia-smi prints them under TZ=UTC: the clock falls from
    # 1980 MHz in the first window to 1700 in the second, and the power cap shows in the third.
    with open(tmp_path / "smi.csv", "w") as f:
        for k in range(40):
            t = t0 - 0.5 + 0.1 * k
            stamp = datetime.datetime.fromtimestamp(t, datetime.timezone.utc)
            sm = 1980 if t < t0 + 1 else 1700
            reasons = 0x4 if t >= t0 + 2 else 0x0
            f.write(stamp.strftime("%Y/%m/%d %H:%M:%S.%f")[:-3] +
                    f", {sm}, 2619, {690 if sm < 1980 else 400}.50, 50, 0x{reasons:016x}\n")


def run_clocks(tmp_path, *extra):
    return subprocess.run([sys.executable, CLOCKS, "clocks", str(tmp_path / "smi.csv"),
                           str(tmp_path / "timing.log"), str(tmp_path / "bench.log"), *extra],
                          capture_output=True, text=True, timeout=60)


def test_attn_clocks_matches_rows_to_their_windows(tmp_path):
    t0 = 1_800_000_000.0
    write_case(tmp_path, t0, [4.382, 4.221, 4.044])
    p = run_clocks(tmp_path)
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    assert out[0] == "40 samples, 3 rows"
    assert "W2 own dense pingpong+dq_tma B4" in out[1] and "SM 1980 MHz mean, 1980 min" in out[1]
    assert "reps 4.482 first, 4.282 last" in out[1] and "reasons 0x0" in out[1]
    # A row timed alone gets its energy (mean power x median time); alternated rows share their
    # window's samples, so they get none.
    assert "(about 1755 mJ a call)" in out[1] and "mJ" not in out[2] + out[3]
    assert "alt. B4" in out[2] and "SM 1700 MHz mean, 1700 min" in out[2] and "690 max;" in out[2]
    assert "sdpa cudnn alt." in out[3] and "reasons 0x4" in out[3]
    assert all("10 samples" in l for l in out[1:]), out
    # --rows keeps the matching rows only.
    p = run_clocks(tmp_path, "--rows", "sdpa")
    assert p.returncode == 0 and len(p.stdout.splitlines()) == 2, p.stdout


def test_attn_clocks_refuses_a_log_of_another_run(tmp_path):
    write_case(tmp_path, 1_800_000_000.0, [4.382, 4.5, 4.044])
    p = run_clocks(tmp_path)
    assert p.returncode != 0
    assert "does not match its timing" in p.stderr


def test_attn_clocks_nsys_summary(tmp_path):
    # The columns of `nsys stats -r cuda_gpu_trace -f csv` that the summary reads.
    rows = ['"Start (ns)","Duration (ns)","GrdX","GrdY","GrdZ","Name"']
    for i, d in enumerate([900_000, 1_000_000, 950_000]):
        rows.append(f'{i},{d},132,1,1,"void colossal::kernels::sm90::attention_fwd_kernel<A>(B)"')
    for i, d in enumerate([2_500_000, 2_600_000]):
        rows.append(f'{i},{d},4096,1,1,"void colossal::kernels::sm90::attention_bwd_kernel<C>(D)"')
    rows.append('0,50,1,1,1,"tiny_kernel"')  # under 100 us in all: left out
    (tmp_path / "trace.csv").write_text("\n".join(rows) + "\n")
    p = subprocess.run([sys.executable, CLOCKS, "nsys", str(tmp_path / "trace.csv")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    assert len(out) == 2, out
    assert re.match(r"\s+2550\.0 us median x2\s+attention_bwd_kernel<C>\(D\) \(4096,1,1\)$", out[0]), out
    assert re.match(r"\s+950\.0 us median x3\s+attention_fwd_kernel<A>\(B\) \(132,1,1\)$", out[1]), out
