// timeline_svg(): a standalone SVG of a simulated schedule (one row per rank).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "colossal/pipeline/schedule.h"

namespace colossal::pipeline {
namespace {

std::string fmt(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", x);
  return buf;
}

std::string escape(const std::string& text) {
  std::string out;
  for (char ch : text) {
    if (ch == '<')
      out += "&lt;";
    else if (ch == '>')
      out += "&gt;";
    else if (ch == '&')
      out += "&amp;";
    else if (ch == '"')
      out += "&quot;";
    else
      out += ch;
  }
  return out;
}

const char* colour(Op op) {
  switch (op) {
    case Op::F:
      return "#4e79a7";
    case Op::B:
      return "#f28e2b";
    case Op::W:
      return "#59a14f";
    case Op::BW:
      return "#e15759";
    default:
      return "#bab0ac";
  }
}

}  // namespace

std::string timeline_svg(const Schedule& s, const SimResult& r) {
  const double left = 70, top = 40, row = 28, width = 1000;
  const double span = r.step_time > 0 ? r.step_time : 1.0;
  const double scale = width / span;
  const double height = top + row * s.stages + 50;
  std::ostringstream os;
  os << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
     << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << fmt(left + width + 20)
     << "\" height=\"" << fmt(height) << "\" font-family=\"sans-serif\" font-size=\"10\">\n";
  const std::string name = escape(s.name);
  os << "<title>" << name << ": step " << fmt(r.step_time) << ", bubble "
     << fmt(100 * r.bubble_fraction) << "%</title>\n";
  os << "<text x=\"" << fmt(left) << "\" y=\"20\" font-size=\"14\">" << name
     << " (stages=" << s.stages << ", microbatches=" << s.microbatches << ", chunks=" << s.chunks
     << "): step time " << fmt(r.step_time) << ", bubble " << fmt(100 * r.bubble_fraction)
     << "%</text>\n";
  for (int k = 0; k < s.stages; ++k) {
    const double y = top + row * k;
    os << "<text x=\"5\" y=\"" << fmt(y + row * 0.6) << "\">rank " << k << "</text>\n";
    os << "<line x1=\"" << fmt(left) << "\" y1=\"" << fmt(y + row - 2) << "\" x2=\""
       << fmt(left + width) << "\" y2=\"" << fmt(y + row - 2) << "\" stroke=\"#ddd\"/>\n";
  }
  for (const SimEvent& e : r.events) {
    if (!is_compute(e.instr.op)) continue;
    const double x = left + e.start * scale, w = std::max(0.5, (e.end - e.start) * scale);
    const double y = top + row * e.rank;
    os << "<rect x=\"" << fmt(x) << "\" y=\"" << fmt(y) << "\" width=\"" << fmt(w) << "\" height=\""
       << fmt(row - 6) << "\" fill=\"" << colour(e.instr.op)
       << "\" stroke=\"#333\" stroke-width=\"0.5\"><title>rank " << e.rank << " "
       << to_string(e.instr) << " [" << fmt(e.start) << ", " << fmt(e.end) << "]</title></rect>\n";
    if (w >= 18)
      os << "<text x=\"" << fmt(x + w / 2) << "\" y=\"" << fmt(y + row * 0.5)
         << "\" text-anchor=\"middle\" fill=\"white\">" << to_string(e.instr.op) << e.instr.mb
         << (s.chunks > 1 ? "." + std::to_string(e.instr.chunk) : std::string()) << "</text>\n";
  }
  // Time axis: about ten ticks at a round step.
  const double axis_y = top + row * s.stages + 5;
  os << "<line x1=\"" << fmt(left) << "\" y1=\"" << fmt(axis_y) << "\" x2=\"" << fmt(left + width)
     << "\" y2=\"" << fmt(axis_y) << "\" stroke=\"black\"/>\n";
  double step = std::pow(10.0, std::floor(std::log10(span / 10)));
  if (span / step > 20)
    step *= 5;
  else if (span / step > 10)
    step *= 2;
  for (double t = 0; t <= span + 1e-9; t += step) {
    const double x = left + t * scale;
    os << "<line x1=\"" << fmt(x) << "\" y1=\"" << fmt(axis_y) << "\" x2=\"" << fmt(x) << "\" y2=\""
       << fmt(axis_y + 4) << "\" stroke=\"black\"/>\n";
    os << "<text x=\"" << fmt(x) << "\" y=\"" << fmt(axis_y + 15) << "\" text-anchor=\"middle\">"
       << fmt(t) << "</text>\n";
  }
  os << "<text x=\"" << fmt(left + width) << "\" y=\"" << fmt(axis_y + 30)
     << "\" text-anchor=\"end\">time</text>\n";
  os << "</svg>\n";
  return os.str();
}

std::string timeline_html(const Schedule& s, const SimResult& r) {
  const std::string picture = timeline_svg(s, r);  // inline: without its XML declaration
  return "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + escape(s.name) +
         " schedule</title></head><body>\n" + picture.substr(picture.find("<svg")) + "<pre>" +
         escape(describe(s)) + "</pre>\n</body></html>\n";
}

}  // namespace colossal::pipeline
