#include "daemon/worker/registration_decoder.h"

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "daemon/testing/test_registrations.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {

using testing::Registration;

// What LayoutFromProto decodes of the request's tensors and worker: the reference.
absl::StatusOr<Layout> Reference(const v1::RegisterWorkerRequest& r) {
  v1::Layout l;
  *l.mutable_tensors() = r.tensors();
  *l.add_workers() = r.worker();
  return LayoutFromProto(l);
}

absl::StatusOr<Layout> Decoded(const v1::RegisterWorkerRequest& r, int64_t max_pieces = 1 << 20) {
  auto split = SplitRegistration::Of(r);
  if (!split.ok()) return split.status();
  return DecodeWorkerLayout(*split, max_pieces);
}

// The same request with its worker sent encoded, as the worker libraries send it.
v1::RegisterWorkerRequest Encoded(v1::RegisterWorkerRequest r) {
  r.set_worker_encoded(r.worker().SerializeAsString());
  r.clear_worker();
  return r;
}

void CheckSameLayout(const Layout& a, const Layout& b) {
  REQUIRE(a.tensors.size() == b.tensors.size());
  for (size_t t = 0; t < a.tensors.size(); ++t) {
    CHECK(a.tensors[t].name == b.tensors[t].name);
    CHECK(a.tensors[t].shape == b.tensors[t].shape);
    CHECK(a.tensors[t].dtype == b.tensors[t].dtype);
  }
  REQUIRE(a.workers.size() == 1);
  REQUIRE(b.workers.size() == 1);
  CHECK(a.workers[0].name == b.workers[0].name);
  REQUIRE(a.buffers.size() == b.buffers.size());
  for (size_t i = 0; i < a.buffers.size(); ++i) {
    CHECK(a.buffers[i].name == b.buffers[i].name);
    CHECK(a.buffers[i].shape == b.buffers[i].shape);
  }
  REQUIRE(a.pieces.size() == b.pieces.size());
  for (size_t i = 0; i < a.pieces.size(); ++i) {
    CHECK(a.pieces[i].tensor == b.pieces[i].tensor);
    CHECK(a.pieces[i].buffer == b.pieces[i].buffer);
    CHECK(a.tensor_box(a.pieces[i]) == b.tensor_box(b.pieces[i]));
    CHECK(a.buffer_box(a.pieces[i]) == b.buffer_box(b.pieces[i]));
  }
}

// Two tensors over three buffers: pieces by name and by index, boxes explicit and omitted.
v1::RegisterWorkerRequest Mixed() {
  v1::RegisterWorkerRequest r = Registration("w0", v1::TRAINER, 0, 8, 0);
  v1::TensorSpec* b = r.add_tensors();
  b->set_name("b");
  b->add_shape(6);
  b->set_dtype("f32");
  v1::Buffer* whole = r.mutable_worker()->add_buffers();
  whole->set_name("b.whole");
  whole->set_dtype("f32");
  whole->add_shape(6);
  whole->add_pieces()->set_tensor_index(2);  // both boxes omitted: all of each
  v1::Buffer* halves = r.mutable_worker()->add_buffers();
  halves->set_name("b.halves");
  halves->set_dtype("f32");
  halves->add_shape(2);
  halves->add_shape(3);
  for (int half = 0; half < 2; ++half) {
    v1::Piece* p = halves->add_pieces();
    p->set_tensor("b");
    p->mutable_tensor_box()->add_origin(3 * half);
    p->mutable_tensor_box()->add_shape(3);
    p->mutable_buffer_box()->add_origin(half);
    p->mutable_buffer_box()->add_origin(0);
    p->mutable_buffer_box()->add_shape(1);
    p->mutable_buffer_box()->add_shape(3);
  }
  return r;
}

TEST_CASE("an encoded worker decodes to the layout the codec decodes from its messages") {
  for (const v1::RegisterWorkerRequest& r : {Registration("w0", v1::TRAINER, 2, 6, 0), Mixed()}) {
    auto reference = Reference(r);
    REQUIRE(reference.ok());
    for (const v1::RegisterWorkerRequest& sent : {r, Encoded(r)}) {
      auto decoded = Decoded(sent);
      REQUIRE(decoded.ok());
      CheckSameLayout(*decoded, *reference);
    }
  }
}

TEST_CASE("a bad piece is refused with the codec's words, whichever field carries the worker") {
  auto bad = [](auto&& edit) {
    v1::RegisterWorkerRequest r = Mixed();
    edit(r.mutable_worker()->mutable_buffers(2)->mutable_pieces(1));
    return r;
  };
  const v1::RegisterWorkerRequest cases[] = {
      bad([](v1::Piece* p) { p->set_tensor("nowhere"); }),
      bad([](v1::Piece* p) { p->set_tensor_index(7); }),
      bad([](v1::Piece* p) { p->set_tensor_index(1); }),  // names "b", index 1 is "w"
      bad([](v1::Piece* p) { p->mutable_tensor_box()->add_shape(1); }),
      bad([](v1::Piece* p) { p->mutable_buffer_box()->set_shape(0, -1); }),
  };
  for (const v1::RegisterWorkerRequest& r : cases) {
    const absl::Status reference = Reference(r).status();
    REQUIRE(!reference.ok());
    for (const v1::RegisterWorkerRequest& sent : {r, Encoded(r)}) {
      const absl::Status s = Decoded(sent).status();
      INFO(s.message());
      CHECK(s.code() == absl::StatusCode::kInvalidArgument);
      CHECK(s.message() == reference.message());
    }
  }
}

TEST_CASE("runs, too many pieces and a worker that is not one are refused") {
  v1::RegisterWorkerRequest run = Mixed();
  run.mutable_worker()->mutable_buffers(2)->mutable_pieces(0)->set_tensor_index_step(1);
  CHECK(absl::StrContains(Decoded(run).status().message(), "a registration lists its pieces"));

  const absl::Status over = Decoded(Mixed(), 2).status();
  CHECK(over.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(over.message(), "more than 2 pieces"));

  v1::RegisterWorkerRequest garbage = Mixed();
  garbage.clear_worker();
  garbage.set_worker_encoded("\x22\x05\x0a");  // buffers: 5 bytes announced, 1 there
  const absl::Status s = SplitRegistration::Of(garbage).status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(s.message(), "not a valid Worker"));

  v1::RegisterWorkerRequest both = Encoded(Mixed());
  both.mutable_worker()->set_name("w0");
  CHECK(absl::StrContains(SplitRegistration::Of(both).status().message(),
                          "both worker and worker_encoded"));
}

TEST_CASE("a split keeps everything but the pieces as messages, and the worker's whole encoding") {
  const v1::RegisterWorkerRequest r = Mixed();
  for (const v1::RegisterWorkerRequest& sent : {r, Encoded(r)}) {
    auto split = SplitRegistration::Of(sent);
    REQUIRE(split.ok());
    CHECK(split->worker() == r.worker().SerializeAsString());
    CHECK(split->request_bytes() == static_cast<int64_t>(sent.ByteSizeLong()));
    const v1::RegisterWorkerRequest& h = split->header();
    CHECK(h.worker_encoded().empty());
    CHECK(h.group() == "policy");
    CHECK(h.tensors_size() == 2);
    REQUIRE(h.worker().buffers_size() == 3);
    CHECK(h.worker().name() == "w0");
    CHECK(h.worker().buffers(1).name() == "b.whole");
    for (const v1::Buffer& b : h.worker().buffers()) CHECK(b.pieces().empty());
    CHECK(CountPieces(split->worker()) == 4);
    std::vector<std::pair<int, int>> visited;
    REQUIRE(ForEachPiece(split->worker(), [&](int buffer, int k, const v1::Piece&) {
              visited.emplace_back(buffer, k);
              return absl::OkStatus();
            }).ok());
    CHECK(visited == std::vector<std::pair<int, int>>{{0, 0}, {1, 0}, {2, 0}, {2, 1}});
  }
}

TEST_CASE("a registration's worker is cut out whole, its occurrences merged, the rest kept") {
  const v1::RegisterWorkerRequest r = Mixed();
  // As a node keeps it: the worker, then a second occurrence setting its node and GPU.
  v1::RegisterWorkerRequest placed;
  placed.mutable_worker()->set_node(3);
  placed.mutable_worker()->set_gpu(5);
  const std::string kept = r.SerializeAsString() + placed.SerializeAsString();
  std::string rest, worker;
  REQUIRE(SplitOutWorker(kept, &rest, &worker));
  v1::RegisterWorkerRequest sent;
  REQUIRE(sent.ParseFromString(rest));
  CHECK_FALSE(sent.has_worker());
  sent.set_worker_encoded(worker);
  v1::RegisterWorkerRequest expected = r;
  expected.mutable_worker()->set_node(3);
  expected.mutable_worker()->set_gpu(5);
  auto split = SplitRegistration::Of(sent);
  REQUIRE(split.ok());
  v1::Worker whole;
  REQUIRE(whole.ParseFromString(std::string(split->worker())));
  CHECK(whole.SerializeAsString() == expected.worker().SerializeAsString());
  CHECK(split->header().tensors_size() == r.tensors_size());
  CHECK(split->header().group() == r.group());
  auto decoded = DecodeWorkerLayout(*split, 1 << 20);
  auto reference = Reference(expected);
  REQUIRE(decoded.ok());
  REQUIRE(reference.ok());
  CheckSameLayout(*decoded, *reference);

  // Not an encoding, or one that already carries worker_encoded: refused.
  std::string r2, w2;
  CHECK_FALSE(SplitOutWorker("\xff\xff", &r2, &w2));
  CHECK_FALSE(SplitOutWorker(sent.SerializeAsString(), &r2, &w2));
  // A truncated tag at the end is not the end (ReadTag answers 0 for both).
  CHECK(CountPieces("\xff\xff") == -1);
  CHECK(CountPieces(whole.SerializeAsString() + "\x80") == -1);
}

}  // namespace
}  // namespace refit
