// TensorBoard events through the protobuf code protoc generated from tensorboard_event.proto.
#include "tensorboard_events.h"

#include <stdexcept>

#include "tensorboard_event.pb.h"

namespace colossal::tensorboard_proto {

namespace pb = ::colossal::tensorboard;

namespace {

std::string serialize(const pb::Event& e) {
  GOOGLE_PROTOBUF_VERIFY_VERSION;
  std::string bytes;
  if (!e.SerializeToString(&bytes))
    throw std::runtime_error("cannot serialize a TensorBoard event");
  return bytes;
}

pb::Event event(double wall_time, int64_t step) {
  pb::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  return e;
}

}  // namespace

std::string file_version_event(double wall_time, std::string_view version) {
  pb::Event e = event(wall_time, 0);
  e.set_file_version(std::string(version));
  return serialize(e);
}

std::string scalar_event(double wall_time, int64_t step, std::string_view tag, float value,
                         bool with_metadata) {
  pb::Event e = event(wall_time, step);
  pb::Summary::Value* v = e.mutable_summary()->add_value();
  v->set_tag(std::string(tag));
  v->set_simple_value(value);
  if (with_metadata) {
    pb::SummaryMetadata* md = v->mutable_metadata();
    md->mutable_plugin_data()->set_plugin_name("scalars");
    md->set_data_class(pb::DATA_CLASS_SCALAR);
  }
  return serialize(e);
}

std::string session_start_event(double wall_time, int64_t step) {
  pb::Event e = event(wall_time, step);
  e.mutable_session_log()->set_status(pb::SessionLog::START);
  return serialize(e);
}

}  // namespace colossal::tensorboard_proto
