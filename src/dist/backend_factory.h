// Internal: construction of the c10d engines, each in its own translation unit so only one file
// sees Gloo's (and one NCCL's) headers.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace colossal::dist::detail {

// Throw DistError / Error when the engine is not in this build.
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    const std::string& group_name);
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    const std::string& group_name);
bool gloo_compiled();
bool nccl_compiled();

}  // namespace colossal::dist::detail
