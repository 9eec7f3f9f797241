// Serialized TensorBoard `Event` messages (src/proto/tensorboard_event.proto), behind an
// interface free of protobuf types. Compiled apart from the layers: LibTorch ships headers of
// its own, older protobuf under torch/include/google/protobuf, which would shadow the headers of
// the protobuf library we link, so only these sources see the latter (and never LibTorch's).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace colossal::tensorboard_proto {

// An Event with file_version set (a file's first record: "brain.Event:2").
std::string file_version_event(double wall_time, std::string_view version);
// An Event whose Summary holds one Value with simple_value; with_metadata adds the "scalars"
// plugin metadata (data class SCALAR) that a tag's first point carries.
std::string scalar_event(double wall_time, int64_t step, std::string_view tag, float value,
                         bool with_metadata);
// An Event with a SessionLog START at `step`.
std::string session_start_event(double wall_time, int64_t step);

}  // namespace colossal::tensorboard_proto
