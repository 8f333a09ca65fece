#include "daemon/worker/registration_limits.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/base/utf8.h"

namespace refit {
namespace {

// A name quoted for an error message: printable as is, else escaped, and cut short.
std::string Shown(absl::string_view name) {
  std::string out;
  for (size_t i = 0; i < name.size() && out.size() < 64; ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += absl::StrFormat("\\x%02x", c);
    }
  }
  if (out.size() >= 64) out += "...";
  return out;
}

}  // namespace

absl::Status OverRegistrationLimit(absl::string_view what, int64_t n, int64_t limit,
                                   absl::string_view flag) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "register: ", n, " ", what, " in one registration, more than ", limit, " (--", flag, ")"));
}

absl::Status CheckName(absl::string_view what, absl::string_view name) {
  if (name.empty())
    return absl::InvalidArgumentError(absl::StrCat("register: \"", what, "\" is empty"));
  if (name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("register: ", what, " name \"", Shown(name),
                                                   "\" is ", name.size(), " bytes, more than ",
                                                   kMaxNameBytes));
  }
  for (size_t i = 0; i < name.size();) {
    const auto c = static_cast<unsigned char>(name[i]);
    const size_t n = Utf8SequenceLength(name, i);
    if (n == 0 || c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("register: ", what, " name \"", Shown(name), "\" holds byte ",
                       absl::StrFormat("0x%02x", c), " at ", i,
                       " (names are printable UTF-8, no control characters)"));
    }
    i += n;
  }
  return absl::OkStatus();
}

absl::Status CheckCounts(int64_t bytes, int64_t tensors, int64_t buffers, int64_t pieces,
                         const RegistrationLimits& limits) {
  if (bytes > limits.max_bytes)
    return OverRegistrationLimit("bytes", bytes, limits.max_bytes, "max-registration-bytes");
  if (tensors > limits.max_tensors)
    return OverRegistrationLimit("tensors", tensors, limits.max_tensors,
                                 "max-registration-tensors");
  if (buffers > limits.max_buffers)
    return OverRegistrationLimit("buffers", buffers, limits.max_buffers,
                                 "max-registration-buffers");
  if (pieces > limits.max_pieces)
    return OverRegistrationLimit("pieces", pieces, limits.max_pieces, "max-registration-pieces");
  return absl::OkStatus();
}

namespace {

// Every name but the pieces', of a request whose worker's buffers are listed (pieces or not).
absl::Status CheckNames(const v1::RegisterWorkerRequest& request) {
  const v1::Worker& w = request.worker();
  if (auto s = CheckName("group", request.group()); !s.ok()) return s;
  if (auto s = CheckName("worker", w.name()); !s.ok()) return s;
  if (!w.replica().empty()) {
    if (auto s = CheckName("replica", w.replica()); !s.ok()) return s;
  }
  if (!w.buffers_like().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("register: worker \"", Shown(w.name()),
                     "\": buffers_like is the compact form of plans between daemons; "
                     "a registration lists its buffers"));
  }
  for (const v1::TensorSpec& t : request.tensors()) {
    if (auto s = CheckName("tensor", t.name()); !s.ok()) return s;
  }
  for (const v1::Buffer& b : w.buffers()) {
    if (auto s = CheckName("buffer", b.name()); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status CheckPiece(const v1::Buffer& b, const v1::Piece& p) {
  if (p.repeat() != 0 || p.run_pieces() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("register: buffer \"", Shown(b.name()),
                     "\": runs of pieces (repeat, run_pieces) are the compact form "
                     "of plans between daemons; a registration lists its pieces"));
  }
  if (!p.tensor().empty()) return CheckName("piece's tensor", p.tensor());
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckRegistration(const v1::RegisterWorkerRequest& request,
                               const RegistrationLimits& limits) {
  const v1::Worker& w = request.worker();
  int64_t pieces = 0;
  for (const v1::Buffer& b : w.buffers()) pieces += b.pieces_size();
  if (auto s = CheckCounts(static_cast<int64_t>(request.ByteSizeLong()), request.tensors_size(),
                           w.buffers_size(), pieces, limits);
      !s.ok()) {
    return s;
  }
  // Names, now that their number is bounded.
  if (auto s = CheckNames(request); !s.ok()) return s;
  for (const v1::Buffer& b : w.buffers()) {
    for (const v1::Piece& p : b.pieces()) {
      if (auto s = CheckPiece(b, p); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::Status CheckRegistration(const SplitRegistration& registration,
                               const RegistrationLimits& limits) {
  const v1::RegisterWorkerRequest& header = registration.header();
  const int64_t pieces = CountPieces(registration.worker());  // none decoded
  if (pieces < 0)
    return absl::InvalidArgumentError("register: the worker's encoding is not a valid Worker");
  if (auto s = CheckCounts(registration.request_bytes(), header.tensors_size(),
                           header.worker().buffers_size(), pieces, limits);
      !s.ok()) {
    return s;
  }
  if (auto s = CheckNames(header); !s.ok()) return s;
  return ForEachPiece(registration.worker(), [&](int buffer, int, const v1::Piece& p) {
    return CheckPiece(header.worker().buffers(buffer), p);
  });
}

}  // namespace refit
