#include "proto/decoded_size.h"

#include <catch2/catch.hpp>
#include <string>

#include "google/protobuf/struct.pb.h"
#include "proto/refit.pb.h"

namespace refit {
namespace {

// The estimate against what the parsed message reports it holds (SpaceUsedLong, which leaves out
// the allocator's headers): never below it, and not far above.
void CheckTracks(const google::protobuf::Message& m) {
  const std::string wire = m.SerializeAsString();
  auto estimate = EstimateDecodedSize(wire, *m.GetDescriptor());
  REQUIRE(estimate.has_value());
  std::unique_ptr<google::protobuf::Message> parsed(m.New());
  REQUIRE(parsed->ParseFromString(wire));
  const auto actual = static_cast<int64_t>(parsed->SpaceUsedLong());
  INFO("wire " << wire.size() << " B, estimate " << estimate->bytes << " B, parsed " << actual
               << " B");
  CHECK(estimate->bytes >= actual);
  CHECK(estimate->bytes <= 2 * actual + 1024);
}

TEST_CASE("the estimate tracks what the parser allocates") {
  SECTION("a registration's tensors, as a model declares them") {
    v1::RegisterWorkerRequest r;
    r.set_group("policy");
    for (int i = 0; i < 5000; ++i) {
      v1::TensorSpec* t = r.add_tensors();
      t->set_name("model.layers." + std::to_string(i) + ".mlp.experts.gate_up_proj.weight");
      t->add_shape(4096);
      t->add_shape(7168);
      t->set_dtype("bf16");
    }
    CheckTracks(r);
  }
  SECTION("empty entries: 2 bytes each on the wire") {
    v1::RegisterWorkerRequest r;
    for (int i = 0; i < 100000; ++i) r.add_tensors();
    CheckTracks(r);
    const std::string wire = r.SerializeAsString();
    auto estimate = EstimateDecodedSize(wire, *r.GetDescriptor());
    REQUIRE(estimate.has_value());
    CHECK(estimate->bytes > 30 * static_cast<int64_t>(wire.size()));
    CHECK(estimate->fields[v1::RegisterWorkerRequest::kTensorsFieldNumber].occurrences == 100000);
  }
  SECTION("long packed numbers and long strings") {
    v1::RegisterWorkerRequest r;
    v1::TensorSpec* t = r.add_tensors();
    for (int i = 0; i < 100000; ++i) t->add_shape(i % 100);
    t->set_name(std::string(100000, 'x'));
    r.set_fd_token(std::string(5, 'a'));
    CheckTracks(r);
  }
}

TEST_CASE("fields asked to be skipped are neither counted nor read") {
  v1::RegisterWorkerRequest r;
  r.set_group("policy");
  r.set_worker_encoded(std::string(1 << 20, '\xff'));  // not a Worker: never walked into
  for (int i = 0; i < 1000; ++i) r.add_tensors();
  const std::string wire = r.SerializeAsString();
  const google::protobuf::FieldDescriptor* skip[] = {
      v1::RegisterWorkerRequest::descriptor()->FindFieldByNumber(
          v1::RegisterWorkerRequest::kWorkerEncodedFieldNumber),
      v1::RegisterWorkerRequest::descriptor()->FindFieldByNumber(
          v1::RegisterWorkerRequest::kTensorsFieldNumber)};
  auto all = EstimateDecodedSize(wire, *r.GetDescriptor());
  auto some = EstimateDecodedSize(wire, *r.GetDescriptor(), skip);
  REQUIRE(all.has_value());
  REQUIRE(some.has_value());
  CHECK(all->bytes > (1 << 20));
  CHECK(some->bytes < 1024);
  const DecodedSize::Field tensors = some->fields[v1::RegisterWorkerRequest::kTensorsFieldNumber];
  CHECK(tensors.occurrences == 1000);
  CHECK(tensors.bytes == 0);
}

void AppendLengthDelimited(int number, const std::string& payload, std::string* out) {
  out->push_back(static_cast<char>(number << 3 | 2));
  for (uint64_t n = payload.size();; n >>= 7) {
    out->push_back(static_cast<char>((n & 0x7f) | (n >= 0x80 ? 0x80 : 0)));
    if (n < 0x80) break;
  }
  out->append(payload);
}

// ListValue { values: Value { list_value: ListValue { ... } } }, `depth` lists deep: written by
// hand, since protobuf's serializer would not parse it back past 100 levels either.
std::string NestedLists(int depth) {
  google::protobuf::Value one;
  one.set_number_value(1);
  std::string list;
  AppendLengthDelimited(1, one.SerializeAsString(), &list);
  for (int i = 1; i < depth; ++i) {
    std::string value, outer;
    AppendLengthDelimited(6, list, &value);   // Value.list_value
    AppendLengthDelimited(1, value, &outer);  // ListValue.values
    list = std::move(outer);
  }
  return list;
}

TEST_CASE("what the parser would refuse is refused") {
  v1::RegisterWorkerRequest r;
  r.set_group("policy");
  r.add_tensors()->set_name("w");
  const std::string wire = r.SerializeAsString();
  const auto& type = *v1::RegisterWorkerRequest::descriptor();
  CHECK(EstimateDecodedSize(wire, type).has_value());
  CHECK_FALSE(EstimateDecodedSize(wire.substr(0, wire.size() - 1), type).has_value());
  CHECK_FALSE(EstimateDecodedSize(std::string("\x0a\xff\xff\xff\xff\x0f", 6), type).has_value());
  CHECK_FALSE(EstimateDecodedSize(std::string("\x00", 1), type).has_value());
  // A packed number cut in its middle.
  CHECK_FALSE(EstimateDecodedSize(std::string("\x22\x03\x12\x01\x80", 5), type).has_value());
  // Nesting: protobuf's parser stops at 100 levels; so does the estimate.
  const auto& list = *google::protobuf::ListValue::descriptor();
  CHECK(EstimateDecodedSize(NestedLists(40), list).has_value());
  CHECK_FALSE(EstimateDecodedSize(NestedLists(60), list).has_value());
}

}  // namespace
}  // namespace refit
