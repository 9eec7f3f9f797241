// `colossal check`: what this build contains and what this machine offers -- versions (colossal,
// LibTorch, CUDA runtime and driver, NCCL), collective engines, devices and CUDA kernels. Runs
// on machines without a GPU. --json prints the same as one JSON object.
#include <torch/headeronly/version.h>
#include <unistd.h>

#include <cstdio>
#include <thread>

#include "cli/args.h"
#include "cli/command.h"
#include "colossal/core/accelerator.h"
#include "colossal/core/json.h"
#include "colossal/core/version.h"
#include "colossal/dist/communicator.h"

namespace colossal::cli {
namespace {

std::string or_none(const std::string& s, const char* none) {
  return s.empty() ? none : s;
}

int run_check(int argc, char** argv) {
  Args args("check", "show versions, collective engines, devices and kernels of this build");
  args.flag("json", "print one JSON object instead of text");
  args.parse(argc, argv);

  using json::Value;
  Value out = Value::object();
  out.set("colossal", version());
  out.set("libtorch", TORCH_VERSION);
  out.set("torch_cuda", torch_has_cuda());
  out.set("cuda_runtime", cuda_runtime_version());
  out.set("cuda_driver", cuda_driver_version());
  out.set("nccl", dist::nccl_version());

  Value backends = Value::object();
  backends.set("gloo", dist::backend_available(dist::Backend::Gloo));
  backends.set("nccl", dist::backend_available(dist::Backend::Nccl));
  out.set("backends", std::move(backends));

  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  out.set("cpu_cores", static_cast<int64_t>(cores));
  Value gpus = Value::array();
  for (const auto& d : cuda_devices()) {
    Value g = Value::object();
    g.set("index", d.index);
    g.set("name", d.name);
    g.set("memory_bytes", d.total_memory);
    g.set("compute_capability", std::to_string(d.major) + "." + std::to_string(d.minor));
    g.set("multiprocessors", d.multiprocessors);
    gpus.push_back(std::move(g));
  }
  out.set("cuda_devices", gpus);
  out.set("cuda_kernels_built", built_with_cuda());
  Value kernels = Value::array();
  for (const auto& k : cuda_kernels()) kernels.push_back(k);
  out.set("cuda_kernels", kernels);

  if (args.on("json")) {
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("colossal        %s\n", version().c_str());
  std::printf("LibTorch        %s (%s)\n", TORCH_VERSION,
              torch_has_cuda() ? "CUDA build" : "CPU-only build");
  std::printf("CUDA runtime    %s\n", torch_has_cuda()
                                          ? or_none(cuda_runtime_version(), "unavailable").c_str()
                                          : "none (CPU-only LibTorch)");
  std::printf("CUDA driver     %s\n",
              or_none(cuda_driver_version(), "none (no GPU driver loaded)").c_str());
  std::printf("NCCL            %s\n", or_none(dist::nccl_version(), "not in this build").c_str());
  std::printf("CPU collectives %s\n",
              dist::backend_available(dist::Backend::Gloo)
                  ? "Gloo (inside libtorch_cpu; headers found at build time)"
                  : "NONE: Gloo headers were not found at build time (install libgloo-dev "
                    "and rebuild); CPU collectives are disabled");
  std::printf("backends        gloo: %s, nccl: %s\n",
              dist::backend_available(dist::Backend::Gloo) ? "yes" : "no",
              dist::backend_available(dist::Backend::Nccl) ? "yes" : "no");
  std::printf("CPU             %ld cores\n", cores);
  auto devs = cuda_devices();
  if (devs.empty()) std::printf("CUDA devices    none\n");
  for (const auto& d : devs)
    std::printf("CUDA device %d   %s, %.1f GiB, compute capability %d.%d, %d SMs\n", d.index,
                d.name.c_str(), static_cast<double>(d.total_memory) / (1024.0 * 1024.0 * 1024.0),
                d.major, d.minor, d.multiprocessors);
  auto ks = cuda_kernels();
  std::string klist;
  for (const auto& k : ks) klist += (klist.empty() ? "" : ", ") + k;
  std::printf("CUDA kernels    %s\n", !built_with_cuda()
                                          ? "none (built without nvcc; ATen fallbacks are used)"
                                      : ks.empty() ? "compiled with nvcc; none registered yet"
                                                   : klist.c_str());
  return 0;
}

}  // namespace

COLOSSAL_COMMAND("check", "show versions, collective engines, devices and kernels of this build",
                 run_check);

}  // namespace colossal::cli
