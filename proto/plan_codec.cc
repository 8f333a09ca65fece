#include "proto/plan_codec.h"

#include <openssl/sha.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "plan/plan_slice.h"
#include "proto/layout_codec.h"

namespace refit {

std::string Sha256(absl::string_view bytes) {
  unsigned char out[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), out);
  return std::string(reinterpret_cast<const char*>(out), sizeof(out));
}

std::string ShortHex(absl::string_view digest) {
  return digest.empty() ? std::string("(none)") : absl::BytesToHexString(digest.substr(0, 6));
}

namespace {

std::string Deterministic(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::io::StringOutputStream stream(&out);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  m.SerializeToCodedStream(&coded);
  coded.Trim();
  return out;
}

// The most a slice may carry: beyond what any plan the planner makes holds.
constexpr int64_t kMaxSliceGpus = int64_t{1} << 20;
constexpr int64_t kMaxSliceMessages = int64_t{1} << 26;
constexpr int64_t kMaxSliceBuffers = int64_t{1} << 26;

void LayoutPartToProto(const Layout& l, int32_t node, v1::SliceLayout* out) {
  for (const Worker& w : l.workers) {
    v1::Worker* p = out->add_workers();
    p->set_name(w.name);
    p->set_node(w.node);
    p->set_gpu(w.gpu);
    p->set_replica(w.replica);
    p->set_replica_rank(w.replica_rank);
    p->set_replica_size(w.replica_size);
  }
  out->set_buffer_count(static_cast<int32_t>(l.buffers.size()));
  for (size_t b = 0; b < l.buffers.size(); ++b) {
    const Buffer& buffer = l.buffers[b];
    if (l.workers[buffer.worker].node != node) continue;
    out->add_buffer_index(static_cast<int32_t>(b));
    out->add_buffer_worker(buffer.worker);
    v1::Buffer* p = out->add_buffers();
    p->set_name(buffer.name);
    p->set_dtype(std::string(DTypeName(buffer.dtype)));
    for (int64_t e : buffer.shape.span()) p->add_shape(e);
  }
}

absl::StatusOr<Layout> LayoutPartFromProto(const v1::SliceLayout& p, absl::string_view side) {
  Layout l;
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("plan slice: the ", side, " layout's ", what));
  };
  for (const v1::Worker& w : p.workers()) {
    Worker& worker = l.workers.emplace_back();
    worker.name = w.name();
    worker.node = w.node();
    worker.gpu = w.gpu();
    worker.replica = w.replica();
    worker.replica_rank = w.replica_rank();
    worker.replica_size = w.replica_size();
  }
  if (p.buffer_count() < 0 || p.buffer_count() > kMaxSliceBuffers)
    return bad("buffer count is out of range");
  if (p.buffer_index_size() != p.buffers_size() || p.buffer_worker_size() != p.buffers_size()) {
    return bad("buffer columns differ in length");
  }
  l.buffers.resize(static_cast<size_t>(p.buffer_count()));
  for (Buffer& b : l.buffers) b.worker = -1;  // elsewhere: never resolved here
  for (int i = 0; i < p.buffers_size(); ++i) {
    const int32_t index = p.buffer_index(i), worker = p.buffer_worker(i);
    if (index < 0 || index >= p.buffer_count() || l.buffers[index].worker != -1) {
      return bad(absl::StrCat("buffer index ", index, " is out of range or repeated"));
    }
    if (worker < 0 || worker >= static_cast<int32_t>(l.workers.size())) {
      return bad(
          absl::StrCat("buffer ", index, " names worker ", worker, " of ", l.workers.size()));
    }
    const v1::Buffer& buffer = p.buffers(i);
    auto dtype = ParseDType(buffer.dtype());
    if (!dtype.ok()) return bad(absl::StrCat("buffer ", index, ": ", dtype.status().message()));
    auto shape = Dims::FromSpan(
        std::span<const int64_t>(buffer.shape().data(), static_cast<size_t>(buffer.shape_size())));
    if (!shape.ok()) return bad(absl::StrCat("buffer ", index, ": ", shape.status().message()));
    for (int64_t e : shape->span()) {
      if (e < 0) return bad(absl::StrCat("buffer ", index, " has a negative extent"));
    }
    l.buffers[index] = Buffer{buffer.name(), worker, *dtype, *shape};
  }
  return l;
}

}  // namespace

std::string PlanInputsDigest(const v1::Layout& src, const v1::Layout& dst,
                             const PlanOptions& options) {
  const Topology& t = options.topology;
  const std::string text = absl::StrCat(
      Sha256(Deterministic(src)), Sha256(Deterministic(dst)), "|routing=", options.routing,
      "|max_message_bytes=", options.max_message_bytes,
      "|max_relay_depth=", options.max_relay_depth, "|gpus_per_node=", t.gpus_per_node,
      "|nics_per_node=", t.nics_per_node, "|nvlink=", t.nvlink_gbps, "|nic=", t.nic_gbps,
      "|local=", t.local_copy_gbps, "|latency=", t.network_latency_us, ",", t.nvlink_latency_us);
  return Sha256(text);
}

std::string SliceToWire(const Plan& slice, int32_t node, const Layout& src, const Layout& dst) {
  v1::PlanSlice p;
  p.set_node(node);
  for (const PlanGpu& g : slice.gpus) p.add_gpu_node(g.node), p.add_gpu_index(g.gpu);
  for (const Message& m : slice.messages) {
    p.add_message_src_gpu(m.src_gpu);
    p.add_message_dst_gpu(m.dst_gpu);
    p.add_message_stage(m.stage);
    p.add_message_link(static_cast<int32_t>(m.link));
    p.add_message_bytes(m.bytes);
    p.add_message_descriptors(m.num_descriptors);
    for (int64_t k = 0; k < m.num_descriptors; ++k) {
      const CopyDescriptor& d = slice.descriptor(m, k);
      p.add_src_buffer(d.src_buffer);
      p.add_dst_buffer(d.dst_buffer);
      p.add_src_offset(d.src_offset);
      p.add_dst_offset(d.dst_offset);
      p.add_inner(d.inner);
      p.add_outer_rank(d.outer_rank);
      for (int i = 0; i < d.outer_rank; ++i) {
        p.add_count(d.count[i]);
        p.add_src_stride(d.src_stride[i]);
        p.add_dst_stride(d.dst_stride[i]);
      }
      p.add_dtypes(static_cast<int32_t>(d.src_dtype) | static_cast<int32_t>(d.dst_dtype) << 8);
      p.add_op(int64_t{d.src_is_destination} | int64_t{static_cast<uint8_t>(d.op)} << 1 |
               int64_t{d.quant_format} << 3 | int64_t{d.block_rows} << 8 |
               int64_t{d.block_cols} << 24);
    }
  }
  for (const ScratchBuffer& s : slice.scratch) {
    p.add_scratch_gpu(s.gpu);
    p.add_scratch_worker(s.worker);
    p.add_scratch_dtype(static_cast<int32_t>(s.dtype));
    p.add_scratch_elements(s.elements);
  }
  p.set_first_scratch_buffer(slice.first_scratch_buffer);
  *p.mutable_stats() = SummaryToProto(slice.stats, false);
  LayoutPartToProto(src, node, p.mutable_source());
  LayoutPartToProto(dst, node, p.mutable_destination());
  return p.SerializeAsString();
}

absl::StatusOr<DecodedSlice> SliceFromWire(absl::string_view wire, int32_t node) {
  v1::PlanSlice p;
  if (!p.ParseFromArray(wire.data(), static_cast<int>(wire.size()))) {
    return absl::InvalidArgumentError("plan slice: the bytes do not parse as a PlanSlice");
  }
  if (p.node() != node) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan slice: made for node ", p.node(), ", not node ", node));
  }
  DecodedSlice out;
  Plan& plan = out.plan;
  auto bad = [](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("plan slice: ", what));
  };
  if (p.gpu_node_size() != p.gpu_index_size() || p.gpu_node_size() > kMaxSliceGpus) {
    return bad("the GPU columns differ in length or are too long");
  }
  for (int i = 0; i < p.gpu_node_size(); ++i) plan.gpus.push_back({p.gpu_node(i), p.gpu_index(i)});
  const int n = p.message_src_gpu_size();
  if (n > kMaxSliceMessages || p.message_dst_gpu_size() != n || p.message_stage_size() != n ||
      p.message_link_size() != n || p.message_bytes_size() != n ||
      p.message_descriptors_size() != n) {
    return bad("the message columns differ in length or are too long");
  }
  const int64_t descriptors = p.src_buffer_size();
  for (int64_t size :
       {int64_t{p.dst_buffer_size()}, int64_t{p.src_offset_size()}, int64_t{p.dst_offset_size()},
        int64_t{p.inner_size()}, int64_t{p.outer_rank_size()}, int64_t{p.dtypes_size()},
        int64_t{p.op_size()}}) {
    if (size != descriptors) return bad("the descriptor columns differ in length");
  }
  plan.messages.reserve(static_cast<size_t>(n));
  plan.descriptors.reserve(static_cast<size_t>(descriptors));
  int64_t next = 0, outer = 0;
  for (int i = 0; i < n; ++i) {
    Message m;
    m.src_gpu = p.message_src_gpu(i);
    m.dst_gpu = p.message_dst_gpu(i);
    if (p.message_stage(i) < 0 || p.message_stage(i) >= kMaxStages || p.message_link(i) < 0 ||
        p.message_link(i) > static_cast<int32_t>(LinkClass::kNetwork)) {
      return bad(absl::StrCat("message ", i, " has a stage or link out of range"));
    }
    m.stage = static_cast<uint8_t>(p.message_stage(i));
    m.link = static_cast<LinkClass>(p.message_link(i));
    m.bytes = p.message_bytes(i);
    m.first_descriptor = next;
    m.num_descriptors = p.message_descriptors(i);
    if (m.num_descriptors < 0 || m.num_descriptors > descriptors - next) {
      return bad(absl::StrCat("message ", i, " claims more descriptors than the slice has"));
    }
    for (int64_t k = next; k < next + m.num_descriptors; ++k) {
      CopyDescriptor d;
      d.src_buffer = p.src_buffer(k);
      d.dst_buffer = p.dst_buffer(k);
      d.src_offset = p.src_offset(k);
      d.dst_offset = p.dst_offset(k);
      d.inner = p.inner(k);
      if (p.outer_rank(k) < 0 || p.outer_rank(k) > kMaxOuterDims ||
          outer + p.outer_rank(k) > p.count_size() || p.count_size() != p.src_stride_size() ||
          p.count_size() != p.dst_stride_size()) {
        return bad(absl::StrCat("descriptor ", k, "'s outer loops are out of range"));
      }
      d.outer_rank = static_cast<uint8_t>(p.outer_rank(k));
      for (int j = 0; j < d.outer_rank; ++j, ++outer) {
        const int64_t loop[3] = {p.count(outer), p.src_stride(outer), p.dst_stride(outer)};
        for (int64_t v : loop) {
          if (!FitsLoop(v)) {
            return bad(absl::StrCat("descriptor ", k, "'s outer loop ", j, " holds ", v,
                                    ", past a descriptor's 32-bit loops"));
          }
        }
        d.count[j] = static_cast<int32_t>(loop[0]);
        d.src_stride[j] = static_cast<int32_t>(loop[1]);
        d.dst_stride[j] = static_cast<int32_t>(loop[2]);
      }
      const int32_t dtypes = p.dtypes(k);
      const int64_t op = p.op(k);
      const int32_t src_dtype = dtypes & 0xff, dst_dtype = (dtypes >> 8) & 0xff,
                    kind = (op >> 1) & 3;
      if ((dtypes >> 16) != 0 || src_dtype > static_cast<int32_t>(DType::kE8M0) ||
          dst_dtype > static_cast<int32_t>(DType::kE8M0) ||
          kind > static_cast<int32_t>(CopyOp::kScale) || op < 0 || (op >> 40) != 0) {
        return bad(absl::StrCat("descriptor ", k, " has a dtype or operation out of range"));
      }
      d.src_dtype = static_cast<DType>(src_dtype);
      d.dst_dtype = static_cast<DType>(dst_dtype);
      d.src_is_destination = (op & 1) != 0;
      d.op = static_cast<CopyOp>(kind);
      d.quant_format = static_cast<uint8_t>((op >> 3) & 0x1f);
      d.block_rows = static_cast<uint16_t>((op >> 8) & 0xffff);
      d.block_cols = static_cast<uint16_t>((op >> 24) & 0xffff);
      d.message = i;
      plan.descriptors.push_back(d);
    }
    next += m.num_descriptors;
    plan.messages.push_back(m);
  }
  if (next != descriptors || outer != p.count_size())
    return bad("descriptors or outer loops that no message carries");
  plan.message_descriptors.resize(plan.descriptors.size());
  for (size_t i = 0; i < plan.descriptors.size(); ++i)
    plan.message_descriptors[i] = static_cast<int32_t>(i);
  const int scratch = p.scratch_gpu_size();
  if (p.scratch_worker_size() != scratch || p.scratch_dtype_size() != scratch ||
      p.scratch_elements_size() != scratch) {
    return bad("the scratch columns differ in length");
  }
  for (int i = 0; i < scratch; ++i) {
    if (p.scratch_dtype(i) < 0 || p.scratch_dtype(i) > static_cast<int32_t>(DType::kE8M0)) {
      return bad(absl::StrCat("scratch buffer ", i, " has a dtype out of range"));
    }
    plan.scratch.push_back({p.scratch_gpu(i), p.scratch_worker(i),
                            static_cast<DType>(p.scratch_dtype(i)), p.scratch_elements(i)});
  }
  plan.first_scratch_buffer = p.first_scratch_buffer();
  const v1::PlanSummary& s = p.stats();
  PlanStats& st = plan.stats;
  st.tensors = s.tensors();
  st.pieces = s.pieces();
  st.transfers = s.transfers();
  st.descriptors = s.descriptors();
  st.messages = s.messages();
  st.bytes_total = s.bytes_total();
  st.bytes_network = s.bytes_network();
  st.bytes_nvlink = s.bytes_nvlink();
  st.bytes_local = s.bytes_local();
  st.bytes_forwarded = s.bytes_forwarded();
  st.bytes_before_conversion = s.bytes_before_conversion();
  st.bytes_gathered = s.bytes_gathered();
  st.scratch_bytes = s.scratch_bytes();
  st.max_nic_bytes = s.max_nic_bytes();
  st.predicted_seconds = s.predicted_seconds();
  st.lower_bound_seconds = s.lower_bound_seconds();
  st.planning_seconds = s.planning_seconds();
  for (const Message& m : plan.messages) st.stages = std::max<int32_t>(st.stages, m.stage + 1);
  auto src = LayoutPartFromProto(p.source(), "source");
  if (!src.ok()) return src.status();
  auto dst = LayoutPartFromProto(p.destination(), "destination");
  if (!dst.ok()) return dst.status();
  out.src = *std::move(src);
  out.dst = *std::move(dst);
  if (absl::Status checked = CheckSlice(plan, node, out.src, out.dst); !checked.ok())
    return checked;
  return out;
}

}  // namespace refit
