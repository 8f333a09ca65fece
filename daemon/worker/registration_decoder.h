// A registration's worker read from its encoding, one piece at a time, never as a tree of
// messages: as a message a piece costs about 500 bytes (the Piece, its two Boxes, their repeated
// fields, the tensor's name), on the wire about 47, and a frontier model's worker registers 10^5
// to 10^6 of them. Workers send their worker encoded (RegisterWorkerRequest.worker_encoded), so
// that gRPC hands the daemon one string; a request that spells it out as a message (`worker`) is
// encoded once here and then read the same way.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "plan/layout.h"
#include "proto/refit.pb.h"

namespace refit {

// A RegisterWorkerRequest as two parts: everything but the worker's pieces as messages (small),
// and the whole worker as its encoding. Views into the request it was split from, which must
// outlive it.
class SplitRegistration {
 public:
  // INVALID_ARGUMENT, starting "register: ", when both `worker` and `worker_encoded` are set or
  // the worker's encoding is not a valid v1::Worker.
  static absl::StatusOr<SplitRegistration> Of(const v1::RegisterWorkerRequest& request);

  // The request without `worker_encoded`, its worker without its buffers' pieces.
  const v1::RegisterWorkerRequest& header() const { return header_; }
  // The whole worker (a v1::Worker), encoded.
  absl::string_view worker() const { return owned_ ? absl::string_view(encoded_) : view_; }
  // The request's size as it came, encoded.
  int64_t request_bytes() const { return request_bytes_; }

 private:
  v1::RegisterWorkerRequest header_;
  absl::string_view view_;  // request.worker_encoded()
  std::string encoded_;     // `worker` encoded here, when the request spelled it out
  bool owned_ = false;
  int64_t request_bytes_ = 0;
};

// The pieces of an encoded worker, in order: `visit(buffer, k, piece)` for piece k of buffer
// `buffer` (both counted from 0), each decoded into one message that the next reuses. Stops at
// the first error `visit` returns; INVALID_ARGUMENT for an encoding that does not parse.
using PieceVisitor = std::function<absl::Status(int buffer, int k, const v1::Piece& piece)>;
absl::Status ForEachPiece(absl::string_view worker, const PieceVisitor& visit);

// How many pieces an encoded worker lists, counted without decoding any (-1: not a valid
// encoding).
int64_t CountPieces(absl::string_view worker);
// The size of an encoded worker's largest piece's encoding (-1: not a valid encoding): pieces are
// decoded one at a time, so this bounds what one costs.
int64_t LargestPiece(absl::string_view worker);

// The worker's part of the layout: LayoutFromProto's result (proto/layout_codec.h) for a layout of
// the header's tensors and this worker, without a message per piece. Registrations list their
// pieces (registration_limits.h refuses runs, CheckRegistration before this): a piece with run
// fields is INVALID_ARGUMENT here. At most `max_pieces` pieces.
absl::StatusOr<Layout> DecodeWorkerLayout(const SplitRegistration& registration,
                                          int64_t max_pieces);

// Appends to `out` the encoded message `bytes` without the fields `drop` at the end of `path`: a
// field numbered path[0] is rewritten with the rest of the path applied to its payload (a
// message), every other field is copied as it is. False if `bytes` is not a valid encoding.
bool AppendWithout(absl::string_view bytes, absl::Span<const int> path,
                   std::initializer_list<int> drop, std::string* out);
void AppendVarint(uint64_t value, std::string* out);

// The encoded RegisterWorkerRequest `registration` cut in two: every field but `worker`, as it
// is, appended to `rest`; and the payloads of every occurrence of `worker` (a parser merges them
// into one) concatenated, appended to `worker`: one Worker's encoding. Sent as `worker_encoded`
// beside `rest`, a daemon reads the worker as one string (SplitRegistration), not a message per
// piece. False if `registration` is not a valid encoding or already carries `worker_encoded`.
bool SplitOutWorker(absl::string_view registration, std::string* rest, std::string* worker);

}  // namespace refit
