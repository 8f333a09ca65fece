#include "proto/decoded_size.h"

#include <algorithm>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/message.h"
#include "google/protobuf/wire_format_lite.h"

namespace refit {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;

constexpr int kMaxDepth = 100;      // protobuf's default recursion limit
constexpr int64_t kHeapBlock = 16;  // an allocation's header, as glibc's malloc keeps it
constexpr int64_t kSlot = 8;        // a repeated field's pointer or number
constexpr int64_t kString = 32;     // std::string itself (short ones live in it)
constexpr int64_t kShortString = 15;

class Estimator {
 public:
  explicit Estimator(absl::Span<const FieldDescriptor* const> skip) : skip_(skip) {}

  // Adds `bytes` as a `type` (null: unknown fields only) to *out; per top-level field to `top`.
  bool Walk(absl::string_view bytes, const Descriptor* type, int depth, int64_t* out,
            DecodedSize* top) {
    if (depth > kMaxDepth) return false;
    CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                        static_cast<int>(bytes.size()));
    while (in.CurrentPosition() != static_cast<int>(bytes.size())) {
      const uint32_t tag = in.ReadTag();
      if (tag == 0) return false;  // a truncated tag, or field 0
      const int number = WireFormatLite::GetTagFieldNumber(tag);
      const FieldDescriptor* field = type == nullptr ? nullptr : type->FindFieldByNumber(number);
      const bool skipped =
          field != nullptr && std::find(skip_.begin(), skip_.end(), field) != skip_.end();
      int64_t cost = 0;
      int64_t occurrences = 1;
      if (WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
        uint32_t length = 0;
        if (!in.ReadVarint32(&length)) return false;
        const int payload = in.CurrentPosition();
        if (!in.Skip(static_cast<int>(length))) return false;
        if (skipped) {
          Count(top, number, 1, 0);
          continue;
        }
        const absl::string_view inner = bytes.substr(payload, length);
        if (field != nullptr && field->type() == FieldDescriptor::TYPE_MESSAGE) {
          cost = MessageBytes(*field->message_type());
          if (!Walk(inner, field->message_type(), depth + 1, &cost, nullptr)) return false;
        } else if (field != nullptr && field->is_repeated() &&
                   field->cpp_type() != FieldDescriptor::CPPTYPE_STRING) {
          occurrences = PackedElements(inner, field->type());
          if (occurrences < 0) return false;
          cost = 2 * kSlot * occurrences;  // grown by doubling: up to twice the elements
        } else {  // a string, bytes, or a field this side does not know (kept as bytes)
          cost = kString + (length > kShortString ? kHeapBlock + length + 1 : 0);
        }
      } else {
        if (!WireFormatLite::SkipField(&in, tag)) return false;
        cost = skipped ? 0 : kSlot;
      }
      *out += cost;
      Count(top, number, occurrences, cost);
    }
    return true;
  }

 private:
  // A message: its object (the prototype's size: every singular field inline), its slot in the
  // repeated field or pointer that holds it, and its allocation's header.
  int64_t MessageBytes(const Descriptor& type) {
    auto [it, inserted] = message_bytes_.try_emplace(&type, 0);
    if (inserted) {
      const google::protobuf::Message* prototype =
          google::protobuf::MessageFactory::generated_factory()->GetPrototype(&type);
      it->second = static_cast<int64_t>(prototype == nullptr ? 64 : prototype->SpaceUsedLong()) +
                   kSlot + kHeapBlock;
    }
    return it->second;
  }

  static void Count(DecodedSize* top, int number, int64_t occurrences, int64_t bytes) {
    if (top == nullptr) return;
    DecodedSize::Field& f = top->fields[number];
    f.occurrences += occurrences;
    f.bytes += bytes;
  }

  // The elements of a packed repeated number; -1 if the payload does not hold whole ones.
  static int64_t PackedElements(absl::string_view payload, FieldDescriptor::Type type) {
    switch (WireFormatLite::WireTypeForFieldType(static_cast<WireFormatLite::FieldType>(type))) {
      case WireFormatLite::WIRETYPE_FIXED32:
        return payload.size() % 4 == 0 ? static_cast<int64_t>(payload.size() / 4) : -1;
      case WireFormatLite::WIRETYPE_FIXED64:
        return payload.size() % 8 == 0 ? static_cast<int64_t>(payload.size() / 8) : -1;
      case WireFormatLite::WIRETYPE_VARINT: {
        // Each varint ends at a byte whose top bit is clear; the payload must end with one.
        if (!payload.empty() && (static_cast<uint8_t>(payload.back()) & 0x80) != 0) return -1;
        return std::count_if(payload.begin(), payload.end(),
                             [](char c) { return (static_cast<uint8_t>(c) & 0x80) == 0; });
      }
      default:
        return -1;
    }
  }

  absl::Span<const FieldDescriptor* const> skip_;
  absl::flat_hash_map<const Descriptor*, int64_t> message_bytes_;
};

}  // namespace

std::optional<DecodedSize> EstimateDecodedSize(absl::string_view encoding, const Descriptor& type,
                                               absl::Span<const FieldDescriptor* const> skip) {
  Estimator estimator(skip);
  DecodedSize out;
  const google::protobuf::Message* prototype =
      google::protobuf::MessageFactory::generated_factory()->GetPrototype(&type);
  out.bytes = prototype == nullptr ? 0 : static_cast<int64_t>(prototype->SpaceUsedLong());
  if (!estimator.Walk(encoding, &type, 0, &out.bytes, &out)) return std::nullopt;
  return out;
}

}  // namespace refit
