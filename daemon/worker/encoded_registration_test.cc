// A registration is checked on its encoding before anything of it is decoded: counts over a limit
// are RESOURCE_EXHAUSTED naming the flag, what is not a RegisterWorkerRequest or would take more
// than 8 times its size decoded is INVALID_ARGUMENT naming why; a real one comes through whole,
// its worker as its encoding whichever way it was sent.
#include "daemon/worker/encoded_registration.h"

#include <catch2/catch.hpp>
#include <string>

#include "absl/strings/str_cat.h"

namespace refit {
namespace {

// A frontier engine rank's registration: `tensors` tensors, one buffer each, `pieces` pieces
// spread over them, each with both boxes (as a flat FSDP shard's are).
v1::RegisterWorkerRequest Real(int tensors, int pieces) {
  v1::RegisterWorkerRequest r;
  r.set_group("policy");
  r.set_role(v1::INFERENCE);
  r.set_fd_token(std::string(32, 'a'));
  v1::Worker* w = r.mutable_worker();
  w->set_name("vllm-dp0-tp0");
  for (int t = 0; t < tensors; ++t) {
    v1::TensorSpec* spec = r.add_tensors();
    spec->set_name(absl::StrCat("model.layers.", t, ".mlp.experts.w13_weight"));
    spec->add_shape(4096);
    spec->add_shape(7168);
    spec->set_dtype("bf16");
    v1::Buffer* b = w->add_buffers();
    b->set_name(absl::StrCat("b", t));
    b->set_dtype("bf16");
    b->add_shape(4096 * 7168);
    r.add_memory()->mutable_shm()->set_size(int64_t{4096} * 7168 * 2);
  }
  for (int p = 0; p < pieces; ++p) {
    const int t = p % tensors;
    v1::Piece* piece = w->mutable_buffers(t)->add_pieces();
    piece->set_tensor(r.tensors(t).name());
    piece->mutable_tensor_box()->add_origin(p / tensors);
    piece->mutable_tensor_box()->add_origin(0);
    piece->mutable_tensor_box()->add_shape(1);
    piece->mutable_tensor_box()->add_shape(7168);
    piece->mutable_buffer_box()->add_origin((p / tensors) * 7168);
    piece->mutable_buffer_box()->add_shape(7168);
  }
  return r;
}

absl::Status Decoded(const std::string& encoded, const RegistrationLimits& limits = {}) {
  return DecodeRegistrationRequest(encoded, limits).status();
}

TEST_CASE("a real registration comes through whole, its worker as its encoding") {
  const v1::RegisterWorkerRequest r = Real(2000, 60000);
  const std::string worker = r.worker().SerializeAsString();
  SECTION("spelled out") {
    auto decoded = DecodeRegistrationRequest(r.SerializeAsString(), {});
    REQUIRE(decoded.ok());
    CHECK_FALSE(decoded->has_worker());
    CHECK(decoded->worker_encoded() == worker);
    v1::RegisterWorkerRequest back = *decoded;
    back.clear_worker_encoded();
    REQUIRE(back.mutable_worker()->ParseFromString(worker));
    CHECK(back.SerializeAsString() == r.SerializeAsString());
  }
  SECTION("encoded by the worker library") {
    v1::RegisterWorkerRequest sent = r;
    sent.clear_worker();
    sent.set_worker_encoded(worker);
    auto decoded = DecodeRegistrationRequest(sent.SerializeAsString(), {});
    REQUIRE(decoded.ok());
    CHECK(decoded->SerializeAsString() == sent.SerializeAsString());
  }
}

TEST_CASE("what is not a registration is named as such") {
  const std::string good = Real(2, 4).SerializeAsString();
  for (const std::string& bad :
       {good.substr(0, good.size() - 1), std::string("\x0a\xff\xff\xff\xff\x0f", 6),
        std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11), std::string(1, '\0')}) {
    const absl::Status s = Decoded(bad);
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(s.message() == "register: the request is not a valid RegisterWorkerRequest encoding");
  }
  v1::RegisterWorkerRequest both = Real(2, 4);
  both.set_worker_encoded(both.worker().SerializeAsString());
  CHECK_THAT(std::string(Decoded(both.SerializeAsString()).message()),
             Catch::Contains("sets both worker and worker_encoded"));
  v1::RegisterWorkerRequest garbage = Real(2, 4);
  garbage.clear_worker();
  garbage.set_worker_encoded("\x22\x05\x0a");
  CHECK(Decoded(garbage.SerializeAsString()).message() ==
        "register: the worker's encoding is not a valid Worker");
}

TEST_CASE("counts over a limit are refused before anything is decoded") {
  RegistrationLimits limits;
  limits.max_tensors = 1000;
  limits.max_buffers = 100;
  limits.max_pieces = 5000;
  std::string tensors;
  for (int i = 0; i < 1001; ++i) tensors += std::string("\x22\x00", 2);  // empty TensorSpecs
  const absl::Status t = Decoded(tensors, limits);
  CHECK(t.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(t.message()), Catch::Contains("--max-registration-tensors"));

  std::string memory;
  for (int i = 0; i < 101; ++i) memory += std::string("\x2a\x00", 2);  // empty BufferMemory
  CHECK_THAT(std::string(Decoded(memory, limits).message()),
             Catch::Contains("101 memory entries in one registration, more than 100 "
                             "(--max-registration-buffers)"));
  CHECK(Decoded(Real(101, 101).SerializeAsString(), limits).code() ==
        absl::StatusCode::kResourceExhausted);  // the memory entries, then the buffers
  const absl::Status pieces = Decoded(Real(10, 5001).SerializeAsString(), limits);
  CHECK(pieces.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(pieces.message()), Catch::Contains("--max-registration-pieces"));

  limits.max_bytes = 1000;
  const absl::Status bytes = Decoded(Real(10, 100).SerializeAsString(), limits);
  CHECK(bytes.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(bytes.message()), Catch::Contains("--max-registration-bytes"));
}

TEST_CASE("a registration that would decode into many times its size is refused") {
  // Within every count, 2 bytes on the wire and 100 decoded each: what an attacker sends.
  std::string tensors;
  for (int i = 0; i < 500000; ++i) tensors += std::string("\x22\x00", 2);
  const absl::Status t = Decoded(tensors);
  CHECK(t.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(t.message()),
             Catch::StartsWith("register: the request would take ") &&
                 Catch::Contains("more than 8 times its 1.0 MB encoding; most of it in tensors "
                                 "(500000 entries"));

  v1::RegisterWorkerRequest buffers = Real(1, 1);
  buffers.mutable_worker()->mutable_buffers()->Reserve(200000);
  for (int i = 0; i < 200000; ++i) buffers.mutable_worker()->add_buffers();
  const absl::Status b = Decoded(buffers.SerializeAsString());
  CHECK(b.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(b.message()), Catch::Contains("most of it in the worker's buffers"));

  // A piece is decoded alone: one of 100 kB of box numbers would still cost 1.6 MB.
  v1::RegisterWorkerRequest piece = Real(1, 1);
  v1::Box* box =
      piece.mutable_worker()->mutable_buffers(0)->mutable_pieces(0)->mutable_buffer_box();
  for (int i = 0; i < 100000; ++i) box->add_origin(1);
  const absl::Status p = Decoded(piece.SerializeAsString());
  CHECK(p.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(p.message()), Catch::StartsWith("register: a piece of the worker is ") &&
                                           Catch::EndsWith(" bytes encoded, more than 4096"));
}

}  // namespace
}  // namespace refit
