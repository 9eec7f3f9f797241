// The run report (see report.h). The page carries the metrics rows as JSON and draws the plots
// with its own script (inline SVG), so it opens anywhere, offline, and its numbers are the file's
// own; the summary and the configuration are plain HTML tables written here.
#include "colossal/app/report.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string_view>
#include <system_error>

#include "colossal/app/run_dir.h"
#include "colossal/checkpoint/atomic.h"
#include "colossal/core/error.h"

namespace colossal::app {

namespace fs = std::filesystem;

std::vector<json::Value> read_metrics(const std::string& path) {
  std::error_code ec;
  COLOSSAL_CHECK_INPUT(fs::exists(path, ec), "metrics file ", path, " does not exist");
  COLOSSAL_CHECK_INPUT(!fs::is_directory(path, ec), "metrics file ", path,
                       " is a folder, not a file");
  std::ifstream f(path);
  COLOSSAL_CHECK_INPUT(f, "metrics file ", path, ": cannot read it: ", std::strerror(errno));
  std::vector<json::Value> rows;
  std::string line;
  int64_t n = 0;
  while (std::getline(f, line)) {
    ++n;
    json::Value m;
    try {
      m = json::parse(line, str(path, " line ", n));
    } catch (const std::exception& e) {
      throw InputError(str("metrics file ", path, " line ", n,
                           " is not a JSON object (a corrupt or cut line): ", e.what()));
    }
    COLOSSAL_CHECK_INPUT(m.is_object(), "metrics file ", path, " line ", n,
                         " is not a JSON object but ", m.type_name());
    const json::Value* step = m.find("step");
    COLOSSAL_CHECK_INPUT(step && step->is_int(), "metrics file ", path, " line ", n,
                         " has no integral \"step\"");
    const json::Value* loss = m.find("loss");
    COLOSSAL_CHECK_INPUT(loss && (loss->is_number() || loss->is_null()), "metrics file ", path,
                         " line ", n, " has no \"loss\" number");
    if (!rows.empty()) {
      const int64_t prev = rows.back().at("step").as_int();
      COLOSSAL_CHECK_INPUT(step->as_int() > prev, "metrics file ", path, " line ", n, ": step ",
                           step->as_int(), " after step ", prev,
                           " (steps must increase; is it two runs' lines in one file?)");
    }
    rows.push_back(std::move(m));
  }
  COLOSSAL_CHECK_INPUT(f.eof(), "metrics file ", path, ": read error after line ", n, ": ",
                       std::strerror(errno));
  COLOSSAL_CHECK_INPUT(!rows.empty(), "metrics file ", path, " is empty: no steps recorded");
  return rows;
}

ReportInput report_input_from_run(const std::string& run_dir, const std::string& metrics_file) {
  ReportInput in;
  in.source = run_dir.empty() ? metrics_file : run_dir;
  std::string metrics = metrics_file;
  if (!run_dir.empty()) {
    std::error_code ec;
    COLOSSAL_CHECK_INPUT(fs::exists(run_dir, ec), "run folder ", run_dir, " does not exist");
    COLOSSAL_CHECK_INPUT(fs::is_directory(run_dir, ec), "run folder ", run_dir,
                         " is not a folder (give a metrics file with --metrics)");
    const bool step_folder = fs::exists(run_dir + "/trainer_state.json", ec);
    if (!step_folder && complete_steps(run_dir).empty()) {
      COLOSSAL_CHECK_INPUT(!metrics.empty(), "run folder ", run_dir,
                           " holds no checkpoint (no step-N folder with trainer_state.json), "
                           "so it records no metrics file: give one with --metrics FILE");
    } else {
      const std::string ckpt = resolve_checkpoint(run_dir);
      json::Value state = json::parse_file(ckpt + "/trainer_state.json");
      if (const json::Value* c = state.find("config"); c && c->is_object()) in.config = *c;
      if (const json::Value* r = state.find("run"); r && r->is_object()) in.run = *r;
      if (metrics.empty()) {
        // Newer checkpoints record the absolute path; older ones the option as it was given.
        if (const json::Value* m = state.find("metrics_file"); m && m->is_string())
          metrics = m->as_string();
        else if (const json::Value* cp =
                     in.config.is_object() ? in.config.find("checkpoint") : nullptr;
                 cp && cp->is_object() && cp->find("metrics_file") &&
                 cp->at("metrics_file").is_string())
          metrics = cp->at("metrics_file").as_string();
        COLOSSAL_CHECK_INPUT(!metrics.empty(), ckpt,
                             "/trainer_state.json records no metrics file (the run had no "
                             "--metrics_file): give one with --metrics FILE");
      }
    }
  }
  COLOSSAL_CHECK_INPUT(!metrics.empty(), "give a run folder or --metrics FILE");
  in.metrics_file = metrics;
  in.rows = read_metrics(metrics);
  return in;
}

namespace {

std::string escape_html(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// JSON inside <script>: '<' never appears raw, so no "</script>" in a value can end the block.
std::string script_json(const json::Value& v) {
  std::string s = v.dump(), out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '<')
      out += "\\u003c";
    else
      out += c;
  }
  return out;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string human(double v, const char* unit = "") {
  const char* suffix[] = {"", "K", "M", "G", "T", "P"};
  int i = 0;
  while (std::fabs(v) >= 1000 && i < 5) {
    v /= 1000;
    ++i;
  }
  std::string out = fmt(i == 0 ? "%.0f" : "%.3g", v);
  if (i > 0 || *unit) out += str(" ", suffix[i], unit);
  return out;
}

std::string bytes(double v) {
  return fmt("%.2f", v / (1024.0 * 1024.0 * 1024.0)) + " GiB";
}

std::string duration(double s) {
  if (s < 120) return fmt("%.1f s", s);
  if (s < 7200) return fmt("%.1f min", s / 60);
  return fmt("%.2f h", s / 3600);
}

const json::Value* field(const json::Value& obj, std::string_view section, std::string_view key) {
  if (!obj.is_object()) return nullptr;
  const json::Value* s = obj.find(section);
  if (!s || !s->is_object()) return nullptr;
  return s->find(key);
}

// Strings without quotes, doubles in their shortest exact form (0.003, not 0.0030000000000000001).
std::string value_text(const json::Value& v) {
  if (v.is_string()) return v.as_string();
  if (v.type() == json::Value::Type::Double && std::isfinite(v.as_double())) {
    char buf[64];
    auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v.as_double());
    if (ec == std::errc()) return std::string(buf, end);
  }
  return v.dump();
}

double number(const json::Value& row, std::string_view key, double otherwise = NAN) {
  const json::Value* v = row.find(key);
  return v && v->is_number() ? v->as_double() : otherwise;
}

std::string summary_table(const ReportInput& in) {
  std::vector<std::pair<std::string, std::string>> rows;
  const auto& r = in.rows;
  const json::Value& first = r.front();
  const json::Value& last = r.back();
  rows.emplace_back("run", in.source);
  rows.emplace_back("metrics file", in.metrics_file);
  std::string steps = str(last.at("step").as_int());
  if (const json::Value* total = field(in.config, "train", "steps"); total && total->is_int())
    steps += str(" of ", total->as_int());
  steps += str(" (", r.size(), " recorded, from step ", first.at("step").as_int(), ")");
  rows.emplace_back("steps", steps);
  const double loss = number(last, "loss");
  rows.emplace_back("final loss", std::isfinite(loss) ? fmt("%.5g", loss) : "not finite");
  double best = INFINITY;
  int64_t best_step = 0, skipped = 0;
  for (const auto& m : r) {
    const double l = number(m, "loss");
    if (std::isfinite(l) && l < best) {
      best = l;
      best_step = m.at("step").as_int();
    }
    if (const json::Value* s = m.find("skipped"); s && s->is_bool() && s->as_bool()) ++skipped;
  }
  if (std::isfinite(best))
    rows.emplace_back("lowest loss", str(fmt("%.5g", best), " at step ", best_step));
  if (skipped > 0) rows.emplace_back("skipped steps", str(skipped, " (non-finite gradients)"));
  if (const double t = number(last, "tokens"); std::isfinite(t))
    rows.emplace_back("tokens", human(t));
  // elapsed_s counts from the start of each process (a resumed run starts again near 0), so
  // the wall time is the sum of each process's last value. A row starts a new process when less
  // time passed since the previous row than its own step took (tokens per step / tok_s): in one
  // process, the step happened between the two readings.
  double wall = 0, stretch = 0;
  bool have_wall = false;
  for (const auto& m : r) {
    const double e = number(m, "elapsed_s");
    if (!std::isfinite(e)) continue;
    const double step_s =
        number(m, "tokens") / static_cast<double>(m.at("step").as_int()) / number(m, "tok_s");
    const bool new_process =
        have_wall && (e < stretch || (std::isfinite(step_s) && e - stretch < step_s * (1 - 1e-6)));
    if (new_process) wall += stretch;
    have_wall = true;
    stretch = e;
  }
  if (have_wall) rows.emplace_back("wall time", duration(wall + stretch));
  std::vector<double> tok;
  for (const auto& m : r)
    if (const double t = number(m, "tok_s"); std::isfinite(t)) tok.push_back(t);
  if (!tok.empty()) {
    std::sort(tok.begin(), tok.end());
    rows.emplace_back("tokens/s (median)", human(tok[tok.size() / 2]));
  }
  std::string plugin;
  if (const json::Value* p = field(in.config, "plugin", "plugin")) plugin = value_text(*p);
  if (const json::Value* p = field(in.config, "plugin", "precision"))
    plugin += (plugin.empty() ? "" : ", ") + value_text(*p);
  if (in.run.is_object())
    if (const json::Value* w = in.run.find("world_size"); w && w->is_int())
      plugin += str(plugin.empty() ? "" : ", ", w->as_int(), " rank(s)");
  if (!plugin.empty()) rows.emplace_back("plugin", plugin);
  std::string model;
  if (const json::Value* m = field(in.config, "model", "init"); m && !value_text(*m).empty())
    model = "init " + value_text(*m);
  else if (const json::Value* m2 = field(in.config, "model", "model"))
    model = value_text(*m2);
  if (in.run.is_object())
    if (const json::Value* p = in.run.find("parameters"); p && p->is_number())
      model += (model.empty() ? "" : ", ") + human(p->as_double()) + " parameters";
  if (!model.empty()) rows.emplace_back("model", model);
  double host = NAN, dev = NAN;
  for (const auto& m : r) {
    const double h = number(m, "host_rss_bytes"), d = number(m, "device_peak_allocated_bytes");
    if (std::isfinite(h)) host = std::isfinite(host) ? std::max(host, h) : h;
    if (std::isfinite(d)) dev = std::isfinite(dev) ? std::max(dev, d) : d;
  }
  if (std::isfinite(dev)) rows.emplace_back("peak device memory (allocated)", bytes(dev));
  if (std::isfinite(host)) rows.emplace_back("peak host memory (resident)", bytes(host));

  std::string out = "<table class=\"kv\" id=\"summary\">\n";
  for (const auto& [k, v] : rows)
    out += str("<tr><th>", escape_html(k), "</th><td>", escape_html(v), "</td></tr>\n");
  return out + "</table>\n";
}

std::string config_table(const json::Value& config) {
  if (!config.is_object())
    return "<p class=\"note\">No recorded configuration (no checkpoint of the run was read).</p>\n";
  std::string out = "<table class=\"kv\" id=\"config\">\n";
  for (const auto& [section, opts] : config.as_object()) {
    out += str("<tr class=\"section\"><th colspan=\"2\">[", escape_html(section), "]</th></tr>\n");
    if (!opts.is_object()) {
      out += str("<tr><th></th><td>", escape_html(value_text(opts)), "</td></tr>\n");
      continue;
    }
    for (const auto& [k, v] : opts.as_object())
      out +=
          str("<tr><th>", escape_html(k), "</th><td>", escape_html(value_text(v)), "</td></tr>\n");
  }
  return out + "</table>\n";
}

constexpr std::string_view kStyle = R"CSS(
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px auto; max-width: 1360px; color: #222; padding: 0 16px; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 24px 0 8px; }
.sub { color: #666; margin-bottom: 16px; word-break: break-all; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(620px, 1fr)); gap: 16px; }
.plot { border: 1px solid #ddd; border-radius: 6px; padding: 8px 8px 4px; background: #fff; }
.plot h3 { font-size: 14px; margin: 0 0 4px; display: flex; justify-content: space-between; }
.plot h3 label { font-weight: normal; font-size: 12px; color: #444; }
.readout { font: 12px ui-monospace, monospace; color: #333; min-height: 1.4em; }
svg { display: block; width: 100%; height: auto; }
svg text { font: 11px system-ui, sans-serif; fill: #444; }
.grid-line { stroke: #eee; } .axis { stroke: #888; }
.series { fill: none; stroke-width: 1.6; stroke-linejoin: round; }
.legend span { margin-right: 12px; font-size: 12px; } .legend i { display: inline-block; width: 12px; height: 3px; vertical-align: middle; margin-right: 4px; }
table.kv { border-collapse: collapse; font-size: 13px; }
table.kv th, table.kv td { text-align: left; padding: 3px 12px 3px 0; vertical-align: top; border-bottom: 1px solid #f0f0f0; }
table.kv th { font-weight: 600; color: #444; } tr.section th { padding-top: 10px; color: #000; }
.note { color: #666; font-style: italic; }
.cols { display: grid; grid-template-columns: 1fr 1fr; gap: 24px; }
)CSS";

// The plots. Each <svg class="chart"> carries its axes' domain (data-x0/x1, data-y0/y1, in
// log10 units when data-yscale is "log") and the pixel box they map to (data-px0/px1 left and
// right, data-py0/py1 bottom and top); each series' <path> holds one point per finite value
// (data-points of them, x = step, y = value * data-scale), so what is drawn maps back to the
// file's numbers.
constexpr std::string_view kScript = R"JS(
(function () {
  'use strict';
  var D = JSON.parse(document.getElementById('report-data').textContent);
  var rows = D.rows, NS = 'http://www.w3.org/2000/svg';
  var W = 640, H = 250, ML = 64, MR = 16, MT = 10, MB = 40;
  var GiB = 1 / (1024 * 1024 * 1024);
  var SPECS = [
    {id: 'loss', title: 'Loss', series: [{key: 'loss', label: 'loss', color: '#1f77b4'}], logToggle: true},
    {id: 'lr', title: 'Learning rate', series: [{key: 'lr', label: 'lr', color: '#ff7f0e'}]},
    {id: 'grad_norm', title: 'Gradient norm (before clipping)', series: [{key: 'grad_norm', label: 'grad norm', color: '#2ca02c'}]},
    {id: 'loss_scale', title: 'Loss scale (fp16)', series: [{key: 'loss_scale', label: 'loss scale', color: '#d62728'}], when: function () {
      return rows.some(function (r) { return typeof r.loss_scale === 'number' && r.loss_scale !== 1; }); }},
    {id: 'tok_s', title: 'Throughput (tokens/s)', series: [{key: 'tok_s', label: 'tokens/s', color: '#9467bd'}]},
    {id: 'memory', title: 'Memory (GiB)', series: [
      {key: 'device_peak_allocated_bytes', label: 'device peak allocated', color: '#8c564b', scale: GiB},
      {key: 'device_allocated_bytes', label: 'device allocated', color: '#e377c2', scale: GiB},
      {key: 'host_rss_bytes', label: 'host resident', color: '#7f7f7f', scale: GiB}]}
  ];

  function el(tag, attrs, parent, text) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmt(v) {
    if (v === 0) return '0';
    var a = Math.abs(v);
    if (a >= 1e6 || a < 1e-3) return v.toExponential(2).replace(/\.?0+e/, 'e');
    return String(+v.toPrecision(4));
  }
  function niceTicks(lo, hi, n) {
    var span = hi - lo, raw = span / n, step = Math.pow(10, Math.floor(Math.log10(raw))), err = raw / step;
    if (err >= 7.5) step *= 10; else if (err >= 3.5) step *= 5; else if (err >= 1.5) step *= 2;
    var out = [];
    for (var t = Math.ceil(lo / step - 1e-9) * step; t <= hi + step * 1e-9; t += step) out.push(Math.abs(t) < step * 1e-9 ? 0 : t);
    return out;
  }
  function finite(v) { return typeof v === 'number' && isFinite(v); }
  // null (a non-finite value in the file) must not become 0.
  function val(r, s) { return finite(r[s.key]) ? r[s.key] * (s.scale || 1) : NaN; }
  function present(s) { return rows.some(function (r) { return finite(r[s.key]); }); }

  function draw(box, spec, log) {
    box.querySelector('svg') && box.removeChild(box.querySelector('svg'));
    var series = spec.series.filter(present);
    var ty = function (v) { return log ? Math.log10(v) : v; };
    var ok = function (v) { return finite(v) && (!log || v > 0); };
    var x0 = rows[0].step, x1 = rows[rows.length - 1].step, y0 = Infinity, y1 = -Infinity;
    series.forEach(function (s) {
      rows.forEach(function (r) {
        var v = val(r, s);
        if (ok(v)) { y0 = Math.min(y0, ty(v)); y1 = Math.max(y1, ty(v)); }
      });
    });
    if (!isFinite(y0)) { y0 = 0; y1 = 1; }
    if (y0 === y1) { var pad = Math.abs(y0) * 0.05 || 0.5; y0 -= pad; y1 += pad; }
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    var px0 = ML, px1 = W - MR, py0 = H - MB, py1 = MT;
    var X = function (s) { return px0 + (s - x0) / (x1 - x0) * (px1 - px0); };
    var Y = function (v) { return py0 + (v - y0) / (y1 - y0) * (py1 - py0); };
    var svg = el('svg', {viewBox: '0 0 ' + W + ' ' + H, 'class': 'chart', id: 'plot-' + spec.id,
      'data-x0': x0, 'data-x1': x1, 'data-y0': y0, 'data-y1': y1, 'data-px0': px0, 'data-px1': px1,
      'data-py0': py0, 'data-py1': py1, 'data-yscale': log ? 'log' : 'linear'});
    box.insertBefore(svg, box.querySelector('.readout'));
    niceTicks(y0, y1, 5).forEach(function (t) {
      var y = Y(t);
      el('line', {x1: px0, x2: px1, y1: y, y2: y, 'class': 'grid-line'}, svg);
      el('text', {x: px0 - 6, y: y + 4, 'text-anchor': 'end'}, svg, log ? fmt(Math.pow(10, t)) : fmt(t));
    });
    niceTicks(x0, x1, 6).filter(function (t) { return t === Math.round(t); }).forEach(function (t) {
      var x = X(t);
      el('line', {x1: x, x2: x, y1: py0, y2: py0 + 5, 'class': 'axis'}, svg);
      el('text', {x: x, y: py0 + 18, 'text-anchor': 'middle'}, svg, String(t));
    });
    el('line', {x1: px0, x2: px1, y1: py0, y2: py0, 'class': 'axis'}, svg);
    el('line', {x1: px0, x2: px0, y1: py0, y2: py1, 'class': 'axis'}, svg);
    el('text', {x: (px0 + px1) / 2, y: H - 4, 'text-anchor': 'middle'}, svg, 'step');
    el('text', {x: 12, y: (py0 + py1) / 2, 'text-anchor': 'middle',
      transform: 'rotate(-90 12 ' + (py0 + py1) / 2 + ')'}, svg, spec.title + (log ? ' (log scale)' : ''));
    series.forEach(function (s) {
      var d = '', n = 0, pen = 'M', alone = [];
      rows.forEach(function (r, i) {
        var v = val(r, s);
        if (!ok(v)) { pen = 'M'; return; }
        d += pen + X(r.step).toFixed(2) + ',' + Y(ty(v)).toFixed(2);
        // A point with no drawn neighbour is no line: it gets a dot.
        if (pen === 'M' && !(i + 1 < rows.length && ok(val(rows[i + 1], s)))) alone.push([X(r.step), Y(ty(v))]);
        pen = 'L';
        n++;
      });
      el('path', {d: d, 'class': 'series', stroke: s.color, 'data-key': s.key, 'data-points': n,
        'data-scale': s.scale || 1}, svg);
      alone.forEach(function (p) { el('circle', {cx: p[0], cy: p[1], r: 2.5, fill: s.color, 'class': 'alone'}, svg); });
    });
    var cursor = el('g', {visibility: 'hidden'}, svg);
    var vline = el('line', {y1: py0, y2: py1, stroke: '#bbb'}, cursor);
    var dots = series.map(function (s) { return el('circle', {r: 3.5, fill: s.color}, cursor); });
    var readout = box.querySelector('.readout');
    svg.addEventListener('mousemove', function (ev) {
      var rect = svg.getBoundingClientRect();
      var sx = (ev.clientX - rect.left) / rect.width * W;
      var step = x0 + (sx - px0) / (px1 - px0) * (x1 - x0), best = 0;
      rows.forEach(function (r, i) { if (Math.abs(r.step - step) < Math.abs(rows[best].step - step)) best = i; });
      var r = rows[best], parts = ['step ' + r.step];
      vline.setAttribute('x1', X(r.step)); vline.setAttribute('x2', X(r.step));
      series.forEach(function (s, i) {
        var v = val(r, s);
        dots[i].setAttribute('visibility', ok(v) ? 'visible' : 'hidden');
        if (ok(v)) { dots[i].setAttribute('cx', X(r.step)); dots[i].setAttribute('cy', Y(ty(v))); }
        parts.push(s.label + ' ' + (finite(v) ? fmt(v) : 'not finite'));
      });
      cursor.setAttribute('visibility', 'visible');
      readout.textContent = parts.join('   ');
    });
    svg.addEventListener('mouseleave', function () {
      cursor.setAttribute('visibility', 'hidden');
      readout.textContent = '';
    });
  }

  var grid = document.getElementById('plots'), missing = [], nonfinite = [], constant = [];
  SPECS.forEach(function (spec) {
    if (!spec.series.some(present) || (spec.when && !spec.when())) {
      var recorded = spec.series.some(function (s) { return rows.some(function (r) { return s.key in r; }); });
      (!recorded ? missing : spec.when ? constant : nonfinite).push(spec.title);
      return;
    }
    var box = document.createElement('div');
    box.className = 'plot';
    var h = document.createElement('h3');
    h.textContent = spec.title;
    box.appendChild(h);
    var legend = document.createElement('div');
    legend.className = 'legend';
    spec.series.filter(present).forEach(function (s) {
      var span = document.createElement('span'), i = document.createElement('i');
      i.style.background = s.color;
      span.appendChild(i);
      span.appendChild(document.createTextNode(s.label));
      legend.appendChild(span);
    });
    if (spec.series.length > 1) box.appendChild(legend);
    var readout = document.createElement('div');
    readout.className = 'readout';
    box.appendChild(readout);
    grid.appendChild(box);
    if (spec.logToggle) {
      var label = document.createElement('label'), cb = document.createElement('input');
      cb.type = 'checkbox';
      cb.id = 'log-' + spec.id;
      cb.addEventListener('change', function () { draw(box, spec, cb.checked); });
      label.appendChild(cb);
      label.appendChild(document.createTextNode(' log scale'));
      h.appendChild(label);
    }
    draw(box, spec, false);
  });
  var notes = [];
  if (nonfinite.length) notes.push('Recorded but never finite: ' + nonfinite.join(', ') + '.');
  if (constant.length) notes.push('Constant (not an fp16 run), not plotted: ' + constant.join(', ') + '.');
  if (missing.length) notes.push('Not recorded in this metrics file: ' + missing.join(', ') + '.');
  document.getElementById('missing').textContent = notes.join(' ');
  document.body.setAttribute('data-rendered', 'ok');
})();
)JS";

}  // namespace

std::string render_report(const ReportInput& in) {
  COLOSSAL_CHECK(!in.rows.empty(), "render_report: no metrics rows");
  json::Value data = json::Value::object();
  json::Value rows = json::Value::array();
  for (const auto& r : in.rows) rows.push_back(r);
  data.set("rows", std::move(rows));
  const std::string title = "colossal run report: " + in.source;
  std::string html;
  html += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  html += str("<title>", escape_html(title), "</title>\n<style>", kStyle, "</style>\n</head>\n");
  html += "<body>\n";
  html +=
      str("<h1>colossal run report</h1>\n<div class=\"sub\">", escape_html(in.source), "</div>\n");
  html += "<h2>Training curves</h2>\n<div class=\"grid\" id=\"plots\"></div>\n";
  html += "<p class=\"note\" id=\"missing\"></p>\n";
  html +=
      "<noscript><p>The plots are drawn by the page's own script; enable "
      "JavaScript.</p></noscript>\n";
  html += "<div class=\"cols\">\n<div>\n<h2>Summary</h2>\n" + summary_table(in) + "</div>\n";
  html += "<div>\n<h2>Configuration</h2>\n" + config_table(in.config) + "</div>\n</div>\n";
  html += str("<script type=\"application/json\" id=\"report-data\">", script_json(data),
              "</script>\n");
  html += str("<script>", kScript, "</script>\n</body>\n</html>\n");
  return html;
}

void write_report(const ReportInput& in, const std::string& path) {
  const std::string html = render_report(in);
  const fs::path parent = fs::path(path).parent_path();
  std::error_code ec;
  COLOSSAL_CHECK_INPUT(parent.empty() || fs::is_directory(parent, ec), "report ", path, ": folder ",
                       parent.string(), " does not exist");
  try {
    checkpoint::write_file_atomic(
        path, [&](int fd) { checkpoint::write_all(fd, html.data(), html.size(), path); });
  } catch (const InputError&) {
    throw;
  } catch (const std::exception& e) {
    throw InputError(str("cannot write the report ", path, ": ", e.what()));
  }
}

}  // namespace colossal::app
