// How much memory a protobuf encoding takes once decoded, told from the encoding alone, so that
// input from a process that is not ours is refused before it is decoded: a message of no fields
// is 2 bytes on the wire and 50 to 100 in memory, so 30 MB of empty entries in a repeated field
// decode into 1.5 GB. protobuf has no such bound of its own (its limits are on bytes and depth).
//
// The estimate follows what the C++ parser allocates: per message, its prototype's size plus a
// slot and an allocation header; per string or bytes field, its size and a heap block; per
// repeated number, 8 bytes (16 packed: the array grows by doubling). It errs high, never low by
// more than the allocator's rounding.
#pragma once

#include <cstdint>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "google/protobuf/descriptor.h"

namespace refit {

struct DecodedSize {
  int64_t bytes = 0;  // the whole message's estimate
  struct Field {
    int64_t occurrences = 0;  // on the wire (a packed field's elements count one each)
    int64_t bytes = 0;        // their share of `bytes`
  };
  absl::flat_hash_map<int, Field> fields;  // the top level's fields, by number
};

// The estimate for `encoding` as a `type`, without decoding it. Fields in `skip` (of any message
// in the tree) are not walked into and add nothing to `bytes`; at the top level their occurrences
// are counted (`fields`, with 0 bytes). nullopt when `encoding` is not a valid
// encoding, or nests deeper than protobuf's own parser accepts (100).
std::optional<DecodedSize> EstimateDecodedSize(
    absl::string_view encoding, const google::protobuf::Descriptor& type,
    absl::Span<const google::protobuf::FieldDescriptor* const> skip = {});

}  // namespace refit
