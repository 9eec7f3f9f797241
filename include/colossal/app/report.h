// `colossal report` and `colossal train --report`: one self-contained HTML page (inline CSS, JS
// and SVG; nothing fetched from the network) with plots of what the metrics file records per
// step (loss, learning rate, gradient norm, loss scale, tokens/s, memory), a summary and the
// run's recorded configuration.
//
// Where the metrics file of a run folder (a --save_dir, or one step-N folder of it) is: the
// path its newest checkpoint's trainer_state.json records ("metrics_file", made absolute by the
// trainer; older checkpoints only have the option as given, taken relative to the current
// folder), unless --metrics names one.
#pragma once

#include <string>
#include <vector>

#include "colossal/core/json.h"

namespace colossal::app {

struct ReportInput {
  std::string metrics_file;
  std::vector<json::Value> rows;  // read_metrics(metrics_file)
  json::Value config;             // the run's options by section (null: not known)
  json::Value run;                // facts not in the options: "parameters", "world_size", ...
  std::string source;             // what the page describes (a folder or the metrics file)
};

// The metrics file's rows, one JSON object per line with an integral "step" (increasing) and a
// "loss" (a number, or null for a non-finite one). InputError naming the file (and the line
// number) when it is missing, empty, or a line is not such an object.
std::vector<json::Value> read_metrics(const std::string& path);

// What `colossal report RUN_DIR [--metrics FILE]` describes: the config and facts of the
// newest complete checkpoint in `run_dir` (empty: none, then `metrics_file` is required) and
// the metrics file (`metrics_file`, or the one the checkpoint records). InputError naming what
// is missing.
ReportInput report_input_from_run(const std::string& run_dir, const std::string& metrics_file);

// The page.
std::string render_report(const ReportInput& in);

// Writes render_report(in) to `path` atomically; InputError naming the path when it cannot.
void write_report(const ReportInput& in, const std::string& path);

}  // namespace colossal::app
