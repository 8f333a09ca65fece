// A registration's size and names are checked before anything of it is decoded: too many pieces,
// buffers or tensors are RESOURCE_EXHAUSTED naming the flag; a name with a NUL, a control
// character or invalid UTF-8, empty or over 256 bytes, is INVALID_ARGUMENT naming the field; the
// compact layout form is refused from a worker.
#include "daemon/worker/registration_limits.h"

#include <catch2/catch.hpp>
#include <string>

namespace refit {
namespace {

v1::RegisterWorkerRequest Request(int buffers, int pieces_each) {
  v1::RegisterWorkerRequest r;
  r.set_group("policy");
  r.set_role(v1::INFERENCE);
  v1::TensorSpec* t = r.add_tensors();
  t->set_name("model.embed_tokens.weight");
  r.mutable_worker()->set_name("vllm-dp0-tp0");
  for (int b = 0; b < buffers; ++b) {
    v1::Buffer* buf = r.mutable_worker()->add_buffers();
    buf->set_name("buf" + std::to_string(b));
    for (int p = 0; p < pieces_each; ++p)
      buf->add_pieces()->set_tensor("model.embed_tokens.weight");
  }
  return r;
}

TEST_CASE("registration limits: counts over a limit are RESOURCE_EXHAUSTED naming the flag") {
  RegistrationLimits limits;
  limits.max_pieces = 100;
  limits.max_buffers = 10;
  limits.max_tensors = 2;
  CHECK(CheckRegistration(Request(10, 10), limits).ok());
  const absl::Status pieces = CheckRegistration(Request(10, 11), limits);
  CHECK(pieces.code() == absl::StatusCode::kResourceExhausted);
  CHECK(pieces.message() ==
        "register: 110 pieces in one registration, more than 100 (--max-registration-pieces)");
  const absl::Status buffers = CheckRegistration(Request(11, 1), limits);
  CHECK(buffers.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(buffers.message()), Catch::Contains("--max-registration-buffers"));
  v1::RegisterWorkerRequest tensors = Request(1, 1);
  for (int i = 0; i < 2; ++i) tensors.add_tensors()->set_name("t" + std::to_string(i));
  CHECK(CheckRegistration(tensors, limits).code() == absl::StatusCode::kResourceExhausted);
  // The defaults take a frontier engine's rank (DeepSeek-V3 TP16: about 47k pieces).
  CHECK(CheckRegistration(Request(64, 1000), RegistrationLimits{}).ok());
}

TEST_CASE("registration limits: the encoded size is bounded too (--max-registration-bytes)") {
  RegistrationLimits limits;
  const v1::RegisterWorkerRequest r = Request(10, 10);
  limits.max_bytes = static_cast<int64_t>(r.ByteSizeLong());
  CHECK(CheckRegistration(r, limits).ok());
  limits.max_bytes -= 1;
  const absl::Status s = CheckRegistration(r, limits);
  CHECK(s.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(s.message()), Catch::Contains("--max-registration-bytes"));
}

TEST_CASE("registration limits: names are 1..256 bytes of printable UTF-8") {
  CHECK(CheckName("buffer", "model.layers.0.mlp.experts.w13_weight").ok());
  CHECK(CheckName("worker", "caf\xc3\xa9-\xe2\x82\xac-\xf0\x9f\x98\x80").ok());  // UTF-8 kept
  CHECK(CheckName("buffer", std::string(256, 'a')).ok());
  const absl::Status longer = CheckName("buffer", std::string(257, 'a'));
  CHECK(longer.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(longer.message()), Catch::Contains("257 bytes, more than 256"));
  CHECK(CheckName("group", "").code() == absl::StatusCode::kInvalidArgument);
  const absl::Status nul = CheckName("tensor", std::string("w\0x", 3));
  CHECK(nul.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(nul.message()), Catch::Contains("byte 0x00 at 1"));
  CHECK_THAT(std::string(nul.message()), Catch::Contains("\"w\\x00x\""));  // shown escaped
  for (const std::string bad :
       {"a\nb", "a\x1b[31m", "a\x7f", "\xff", "\xc0\xaf", "\xed\xa0\x80", "\xe2\x82"}) {
    INFO(bad);
    CHECK(CheckName("worker", bad).code() == absl::StatusCode::kInvalidArgument);
  }
}

TEST_CASE(
    "registration limits: every name of a registration is checked; the compact form is refused") {
  const RegistrationLimits limits;
  v1::RegisterWorkerRequest r = Request(2, 2);
  CHECK(CheckRegistration(r, limits).ok());
  auto refused = [&](v1::RegisterWorkerRequest bad, const std::string& says) {
    const absl::Status s = CheckRegistration(bad, limits);
    INFO(s.message());
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(s.message()), Catch::Contains(says));
  };
  v1::RegisterWorkerRequest g = r;
  g.set_group(std::string("po\0licy", 7));
  refused(g, "group name");
  v1::RegisterWorkerRequest w = r;
  w.mutable_worker()->set_replica("dp\x01");
  refused(w, "replica name");
  v1::RegisterWorkerRequest t = r;
  t.mutable_tensors(0)->set_name(std::string(300, 'x'));
  refused(t, "tensor name");
  v1::RegisterWorkerRequest b = r;
  b.mutable_worker()->mutable_buffers(1)->set_name("buf\n1");
  refused(b, "buffer name");
  v1::RegisterWorkerRequest p = r;
  p.mutable_worker()->mutable_buffers(0)->mutable_pieces(1)->set_tensor("\xff");
  refused(p, "piece's tensor name");
  v1::RegisterWorkerRequest like = r;
  like.mutable_worker()->set_buffers_like("vllm-dp0-tp1");
  refused(like, "buffers_like");
  v1::RegisterWorkerRequest run = r;
  run.mutable_worker()->mutable_buffers(0)->mutable_pieces(0)->set_repeat(1000000);
  refused(run, "runs of pieces");
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

// As the worker libraries send it: the worker encoded, checked without a message per piece.
absl::Status CheckEncoded(v1::RegisterWorkerRequest r, const RegistrationLimits& limits) {
  r.set_worker_encoded(r.worker().SerializeAsString());
  r.clear_worker();
  auto split = SplitRegistration::Of(r);
  if (!split.ok()) return split.status();
  return CheckRegistration(*split, limits);
}

TEST_CASE("registration limits: a worker sent encoded is held to the same limits and names") {
  RegistrationLimits limits;
  limits.max_pieces = 100;
  limits.max_buffers = 10;
  CHECK(CheckEncoded(Request(10, 10), limits).ok());
  const absl::Status pieces = CheckEncoded(Request(10, 11), limits);
  CHECK(pieces.code() == absl::StatusCode::kResourceExhausted);
  CHECK(pieces.message() ==
        "register: 110 pieces in one registration, more than 100 (--max-registration-pieces)");
  CHECK(CheckEncoded(Request(11, 1), limits).code() == absl::StatusCode::kResourceExhausted);

  v1::RegisterWorkerRequest bad_piece = Request(3, 3);
  bad_piece.mutable_worker()->mutable_buffers(2)->mutable_pieces(1)->set_tensor(
      std::string("w\0", 2));
  const absl::Status name = CheckEncoded(bad_piece, limits);
  CHECK(name.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(name.message()), Catch::Contains("piece's tensor"));
  CHECK(name.message() == CheckRegistration(bad_piece, limits).message());

  v1::RegisterWorkerRequest run = Request(2, 2);
  run.mutable_worker()->mutable_buffers(1)->mutable_pieces(0)->set_repeat(3);
  CHECK_THAT(std::string(CheckEncoded(run, limits).message()),
             Catch::Contains("a registration lists its pieces"));
}

}  // namespace
}  // namespace refit
