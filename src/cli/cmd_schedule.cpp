// `colossal schedule`: builds a pipeline schedule (a style, or a user's CSV/JSON table),
// validates it and simulates it: predicted step time, bubble fraction, per-stage peak
// activations and busy time; optionally the instruction listing, the table and an SVG/HTML
// timeline. ColossalAI's flag names (--pp_size, --num_microbatches, --num_model_chunks,
// --pp_style) with short aliases.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "cli/command.h"
#include "colossal/core/error.h"
#include "colossal/core/options.h"
#include "colossal/pipeline/schedule.h"

namespace {

using colossal::InputError;
namespace pp = colossal::pipeline;

void write_file(const std::string& flag, const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  COLOSSAL_CHECK_INPUT(f, "--", flag, ": cannot write ", path);
  f << text;
  COLOSSAL_CHECK_INPUT(f.good(), "--", flag, ": writing ", path, " failed");
}

int run_schedule(int argc, char** argv) {
  int stages = 4, microbatches = 8, chunks = 1;
  std::string style = "1f1b", table, svg, html, csv, json;
  double f_cost = 1.0, b_cost = 1.0, w_cost = 1.0, comm_cost = 0.0;
  bool print = false;
  colossal::OptionSet o;
  o.add("schedule", "pp_size", &stages, "pipeline stages (ranks)")
      .alias("pp_size", "pp")
      .min("pp_size", 1)
      .add("schedule", "num_microbatches", &microbatches, "micro-batches per step")
      .alias("num_microbatches", "microbatches")
      .min("num_microbatches", 1)
      .add("schedule", "num_model_chunks", &chunks,
           "model chunks per rank (interleaved: >= 2, zbv: 2)")
      .alias("num_model_chunks", "chunks")
      .min("num_model_chunks", 1)
      .default_text("num_model_chunks", "1; 2 with interleaved or zbv")
      .add("schedule", "pp_style", &style, "schedule style",
           {"1f1b", "gpipe", "interleaved", "zbh1", "zbv"})
      .add("schedule", "table", &table, "a schedule table (.csv or .json) instead of --pp_style")
      .add("cost", "f_cost", &f_cost, "time of one forward (per chunk)")
      .min("f_cost", 0)
      .add("cost", "b_cost", &b_cost, "time of one input-gradient backward (B); BW = b + w")
      .min("b_cost", 0)
      .add("cost", "w_cost", &w_cost, "time of one weight-gradient backward (W)")
      .min("w_cost", 0)
      .add("cost", "comm_cost", &comm_cost, "latency of one Send -> Recv hand-off")
      .min("comm_cost", 0)
      .add("output", "svg", &svg, "write the timeline as SVG to this file")
      .add("output", "html", &html, "write the timeline and listing as HTML to this file")
      .add("output", "print", &print, "print every rank's instruction list")
      .add("output", "csv", &csv, "write the schedule table as CSV to this file")
      .add("output", "json", &json, "write the schedule table as JSON to this file");
  std::vector<std::string> args(argv + 1, argv + argc);
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::printf(
          "usage: colossal schedule [options]\n"
          "Builds, validates and simulates a pipeline schedule: step time, bubble, per-stage\n"
          "peak activations and busy time. [default] in brackets.\n%s",
          o.help().c_str());
      return 0;
    }
  o.apply_flags(args);
  o.validate();
  // Defaults that follow the style: interleaved 2 chunks, zbv 2 chunks.
  if (!o.was_set("num_model_chunks") && (style == "interleaved" || style == "zbv")) chunks = 2;

  pp::Schedule s;
  if (!table.empty()) {
    for (const char* flag : {"pp_style", "pp_size", "num_microbatches", "num_model_chunks"})
      COLOSSAL_CHECK_INPUT(!o.was_set(flag), "--table ", table, ": --", flag,
                           " comes from the table, do not give it as well");
    s = pp::load_schedule_table(table);
  } else {
    pp::ScheduleOptions so;
    so.style = style;
    so.stages = stages;
    so.microbatches = microbatches;
    so.chunks = chunks;
    s = pp::make_schedule(so);
  }
  pp::Costs c;
  c.f = f_cost;
  c.b = b_cost;
  c.w = w_cost;
  c.comm = comm_cost;
  const pp::SimResult r = pp::simulate(s, c);

  if (print) std::fputs(pp::describe(s).c_str(), stdout);
  std::printf("schedule        %s (stages=%d, microbatches=%d, chunks=%d, placement=%s)\n",
              s.name.c_str(), s.stages, s.microbatches, s.chunks, pp::to_string(s.placement));
  std::printf("costs           f=%g b=%g w=%g comm=%g\n", c.f, c.b, c.w, c.comm);
  std::printf("step time       %.6g\n", r.step_time);
  std::printf("bubble          %.6f\n", r.bubble_fraction);
  if (s.name == "1f1b" && table.empty())
    std::printf("bubble 1f1b     %.6f (analytic (S-1)/(M+S-1) = %d/%d)\n",
                static_cast<double>(s.stages - 1) / (s.microbatches + s.stages - 1), s.stages - 1,
                s.microbatches + s.stages - 1);
  std::printf("stage  peak_activations  busy\n");
  for (int k = 0; k < s.stages; ++k)
    std::printf("%5d  %16d  %.6g\n", k, r.peak_activations[k], r.busy[k]);

  if (!svg.empty()) write_file("svg", svg, pp::timeline_svg(s, r));
  if (!html.empty()) write_file("html", html, pp::timeline_html(s, r));
  if (!csv.empty()) write_file("csv", csv, pp::to_csv(s));
  if (!json.empty()) write_file("json", json, pp::to_json(s));
  return 0;
}

}  // namespace

COLOSSAL_COMMAND("schedule",
                 "build, validate and simulate a pipeline schedule (bubble, memory, timeline)",
                 run_schedule);
