// libFuzzer target for the path untrusted layouts take: bytes -> proto (proto3 JSON, as layout
// files are, and binary protobuf, as plans between daemons carry them in their compact form:
// buffers_like, tensor_index, runs) -> Layout -> validation -> planning -> host execution and
// verification (bounded). Any crash, sanitizer report, leak or hang is a bug: bad input must only
// ever produce an error. Checked too: validation is stable, the compact form of a valid layout
// decodes back to the same layout (what every node relies on to plan the coordinator's plan), and
// a plan of valid layouts executes exactly. Built by tools/fuzz.sh.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/stubs/logging.h"
#include "plan/planner.h"
#include "plan/validate.h"
#include "plan/verify.h"
#include "proto/layout_codec.h"

namespace {

using namespace refit;

// Runs and buffers_like let a few bytes stand for millions of pieces (bounded by the codec at
// kMaxLayoutPieces); the fuzzer's budget is smaller so that each input stays fast.
constexpr int64_t kFuzzMaxPieces = 4096;

std::string Spelled(const Layout& layout) {
  std::string out;
  google::protobuf::io::StringOutputStream stream(&out);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  LayoutToProto(layout).SerializeToCodedStream(&coded);
  coded.Trim();
  return out;
}

// REFIT_FUZZ_VERBOSE=1: say what became of each input (to check that seeds get deep).
void Say(absl::string_view form, const absl::Status& s) {
  static const bool verbose = std::getenv("REFIT_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "%s: %s\n", std::string(form).c_str(), s.ToString().c_str());
}

void Check(Layout& layout, uint8_t flags, absl::string_view form) {
  const absl::Status valid = ValidateLayout(layout, "source");
  Say(form, valid);
  if (!valid.ok()) return;
  // Refit the layout into a copy of itself: every validated layout covers its own needs.
  Layout copy = layout;
  if (!ValidateLayout(copy, "destination").ok()) __builtin_trap();  // validation must be stable

  // The compact form (every combination of its options) decodes to the same layout, valid.
  CompactOptions options;
  options.buffers_like = flags & 1;
  options.tensor_index = flags & 2;
  options.omit_whole_boxes = flags & 4;
  options.runs = flags & 8;
  const v1::Layout compact = CompactLayoutToProto(layout, "fuzz", options);
  auto back = LayoutFromProto(compact);
  if (!back.ok()) __builtin_trap();
  if (Spelled(*back) != Spelled(layout)) __builtin_trap();
  if (!ValidateLayout(*back, "compact").ok()) __builtin_trap();
  // And through the wire.
  auto wire = v1::Layout();
  if (!wire.ParseFromString(compact.SerializeAsString())) __builtin_trap();
  auto again = LayoutFromProto(wire);
  if (!again.ok() || Spelled(*again) != Spelled(layout)) __builtin_trap();

  PlanOptions plan_options;
  plan_options.max_message_bytes = 256;
  auto plan = MakePlan(layout, copy, plan_options);
  if (!plan.ok()) return;
  auto verified = VerifyOnHost(*plan, layout, copy, 1, int64_t{1} << 20);
  if (!verified.ok() && verified.status().code() != absl::StatusCode::kResourceExhausted) {
    __builtin_trap();  // a plan of valid layouts must execute exactly
  }
}

}  // namespace

// Protobuf logs every string field that is not UTF-8 (as most inputs are): silenced, it is noise.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const uint8_t flags = static_cast<uint8_t>(size == 0 ? 0xf : data[size / 2] ^ size);
  // Layout files: proto3 JSON.
  auto layout =
      ParseLayoutJson(absl::string_view(reinterpret_cast<const char*>(data), size), kFuzzMaxPieces);
  if (layout.ok()) Check(*layout, flags, "json");
  // Plans between daemons: binary protobuf, usually compact.
  v1::Layout proto;
  if (proto.ParseFromArray(data, static_cast<int>(size))) {
    auto decoded = LayoutFromProto(proto, kFuzzMaxPieces);
    if (decoded.ok()) Check(*decoded, flags, "binary");
  }
  return 0;
}
