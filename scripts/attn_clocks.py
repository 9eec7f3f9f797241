#!/usr/bin/env python3
"""What the GPU's clocks and power did while each attention row was timed (issue 25).

  attn_clocks.py clocks SMI.csv TIMING.log BENCH.log [--rows REGEX]
      SMI.csv: `nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,
      clocks_event_reasons.active --format=csv,noheader,nounits -lms 20`, run under TZ=UTC
      during the benchmark;
      TIMING.log: bench_kernels --timing_log (one line per timing: start, end, every rep's ms);
      BENCH.log: bench_kernels' table. Prints, per row matching REGEX, its median, its first and
      last rep, and the SM clock, power (with mean power x median time, the energy of a call,
      except for alternated rows, whose two sides share the samples), temperature and
      clock-event reasons sampled inside its timed reps' window. Use power.draw.instant where
      the driver has it: power.draw may be an average over the last second.
  attn_clocks.py nsys TRACE.csv
      TRACE.csv: `nsys stats -r cuda_gpu_trace -f csv`. Prints each kernel (name, grid) with its
      launch count and median duration in the real run, for comparison with Nsight Compute's
      isolated times (scripts/attn_kernel_times.py).
"""
import csv
import datetime
import re
import statistics
import sys


def table_rows(bench_log):
    """The table's attention rows with a time, in print order: (label, dir, ms)."""
    out = []
    for line in open(bench_log):
        if not line.startswith("attention"):
            continue
        m = re.match(r"attention\s+(.*?)\s+(B\d+ h\d+/\d+ .*?)\s{2,}(fwd\+bwd|fwd)\s+(-?[\d.]+)", line)
        if m and float(m.group(4)) >= 0:
            out.append((m.group(1) + " " + m.group(2).strip(), m.group(3), float(m.group(4))))
    return out


def smi_samples(path):
    out = []
    for row in csv.reader(open(path)):
        if len(row) < 6:
            continue
        try:
            t = datetime.datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f")
            out.append((t.replace(tzinfo=datetime.timezone.utc).timestamp(),
                        float(row[1]), float(row[2]), float(row[3]), float(row[4]),
                        int(row[5].strip(), 16)))
        except ValueError:
            continue
    return out


def energy(label, power, ms):
    """Mean power x the median time: a call's energy. Not for alternated rows, whose two sides
    share one window's samples."""
    if "alt." in label:
        return ""
    return f" (about {statistics.mean(power) * ms:.0f} mJ a call)"


def clocks(smi_path, timing_path, bench_log, rows_re):
    rows = table_rows(bench_log)
    timings = [list(map(float, l.split())) for l in open(timing_path) if l.strip()]
    # The ceilings' timings come first; the attention rows are the last len(rows) timings.
    if len(timings) < len(rows):
        sys.exit(f"attn_clocks: {len(rows)} rows but {len(timings)} timings")
    timings = timings[len(timings) - len(rows):]
    samples = smi_samples(smi_path)
    # nvidia-smi prints local time: device_bench.sh's attnclk runs it under TZ=UTC.
    print(f"{len(samples)} samples, {len(rows)} rows")
    for (label, direction, ms), t in zip(rows, timings):
        if not re.search(rows_re, label):
            continue
        reps = t[2:]
        med = sorted(reps)[len(reps) // 2]
        if abs(med - ms) > 0.0006:
            sys.exit(f"attn_clocks: row '{label}' {ms} ms does not match its timing {med:.4f}")
        inside = [s for s in samples if t[0] <= s[0] <= t[1]]
        if not inside:
            print(f"  {label} {direction}: {ms:.3f} ms, no samples in its window")
            continue
        sm = [s[1] for s in inside]
        pw = [s[3] for s in inside]
        reasons = 0
        for s in inside:
            reasons |= s[5]
        print(f"  {label} {direction}: {ms:.3f} ms (reps {reps[0]:.3f} first, {reps[-1]:.3f} last);"
              f" SM {statistics.mean(sm):.0f} MHz mean, {min(sm):.0f} min; power"
              f" {statistics.mean(pw):.0f} W mean, {max(pw):.0f} max{energy(label, pw, ms)};"
              f" {max(s[4] for s in inside):.0f} C; reasons 0x{reasons:x}; {len(inside)} samples")


def nsys(path):
    groups = {}
    for row in csv.DictReader(open(path)):
        name = row.get("Name", "")
        grid = "(%s,%s,%s)" % (row.get("GrdX", "?"), row.get("GrdY", "?"), row.get("GrdZ", "?"))
        try:
            dur = float(row["Duration (ns)"]) / 1000.0
        except (KeyError, ValueError):
            continue
        short = re.sub(r"^void ", "", name)
        short = re.sub(r"colossal::kernels::sm90::", "", short)[:90]
        groups.setdefault((short, grid), []).append(dur)
    for (name, grid), d in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        if sum(d) < 100:
            continue
        print(f"  {statistics.median(d):9.1f} us median x{len(d):<4} {name} {grid}")


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "clocks":
        rx = sys.argv[sys.argv.index("--rows") + 1] if "--rows" in sys.argv else "."
        clocks(sys.argv[2], sys.argv[3], sys.argv[4], rx)
    elif len(sys.argv) == 3 and sys.argv[1] == "nsys":
        nsys(sys.argv[2])
    else:
        sys.exit(__doc__)
