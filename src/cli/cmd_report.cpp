// `colossal report RUN_DIR [--metrics FILE] [--out FILE]`: the run's report page (see
// colossal/app/report.h), by default RUN_DIR/report.html.
#include <cstdio>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/command.h"
#include "colossal/app/report.h"
#include "colossal/core/error.h"

namespace colossal::cli {
namespace {

int run_report(int argc, char** argv) {
  Args args("report [RUN_DIR]",
            "write one self-contained HTML page (plots of the metrics file, summary and "
            "configuration) for a training run. RUN_DIR is its --save_dir (or one step-N folder "
            "of it), whose newest checkpoint records the configuration and the metrics file");
  args.option("metrics",
              "the metrics file (--metrics_file of `colossal train`); default: the "
              "one RUN_DIR's checkpoint records");
  args.option("out",
              "the HTML file to write; default: RUN_DIR/report.html, or next to the "
              "metrics file without RUN_DIR");
  // RUN_DIR may come before or after the flags: pull it out, hand the rest to Args.
  std::vector<char*> flags{argv[0]};
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("-", 0) == 0) {
      flags.push_back(argv[i]);
      if ((a == "--out" || a == "--metrics") && i + 1 < argc) flags.push_back(argv[++i]);
    } else {
      positional.push_back(a);
    }
  }
  args.parse(static_cast<int>(flags.size()), flags.data());
  if (positional.size() > 1)
    throw InputError(str("colossal report takes one RUN_DIR, got ", positional.size(), ": ",
                         positional[0], " ", positional[1], " ..."));
  const std::string run_dir = positional.empty() ? "" : positional[0];
  if (run_dir.empty() && !args.given("metrics"))
    throw InputError("colossal report needs a RUN_DIR (a --save_dir) or --metrics FILE");
  app::ReportInput in =
      app::report_input_from_run(run_dir, args.given("metrics") ? args.str("metrics") : "");
  std::string out = args.given("out") ? args.str("out") : "";
  if (out.empty()) {
    if (!run_dir.empty()) {
      out = run_dir + "/report.html";
    } else {
      const auto slash = in.metrics_file.rfind('/');
      out = (slash == std::string::npos ? std::string() : in.metrics_file.substr(0, slash + 1)) +
            "report.html";
    }
  }
  app::write_report(in, out);
  std::printf("%s\n", out.c_str());
  std::fprintf(stderr, "report of %lld step(s) written to %s\n",
               static_cast<long long>(in.rows.size()), out.c_str());
  return 0;
}

}  // namespace

COLOSSAL_COMMAND("report", "write an HTML report (plots, summary, configuration) of a training run",
                 run_report);

}  // namespace colossal::cli
