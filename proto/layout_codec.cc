#include "proto/layout_codec.h"

#include <fstream>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/json_util.h"
#include "plan/status_macros.h"
#include "plan/validate.h"

namespace refit {
namespace {

absl::StatusOr<Dims> DimsFrom(const google::protobuf::RepeatedField<int64_t>& values,
                              absl::string_view what) {
  auto dims = Dims::FromSpan({values.data(), static_cast<size_t>(values.size())});
  if (!dims.ok()) return Annotate(dims.status(), what);
  for (int d = 0; d < dims->rank; ++d) {
    if ((*dims)[d] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": negative extent ", (*dims)[d], " in dimension ", d));
    }
  }
  return dims;
}

// An omitted box means all of `whole`.
absl::StatusOr<Box> BoxFrom(const v1::Piece& piece, bool tensor_side, const Dims& whole,
                            absl::string_view what) {
  const bool present = tensor_side ? piece.has_tensor_box() : piece.has_buffer_box();
  if (!present) return Box::Whole(whole);
  const v1::Box& b = tensor_side ? piece.tensor_box() : piece.buffer_box();
  auto box = Box::Make({b.origin().data(), static_cast<size_t>(b.origin_size())},
                       {b.shape().data(), static_cast<size_t>(b.shape_size())});
  if (!box.ok()) return Annotate(box.status(), what);
  return box;
}

std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppend(&out, "\\u00", absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string JsonArray(const Dims& d) { return absl::StrCat("[", absl::StrJoin(d.span(), ","), "]"); }

std::string JsonBox(const Box& b) {
  return absl::StrCat("{\"origin\":", JsonArray(b.origin_dims()), ",\"shape\":",
                      JsonArray(b.shape_dims()), "}");
}

void DimsTo(const Dims& d, google::protobuf::RepeatedField<int64_t>* out) {
  for (int i = 0; i < d.rank; ++i) out->Add(d[i]);
}

void BoxTo(const Box& b, v1::Box* out) {
  DimsTo(b.origin_dims(), out->mutable_origin());
  DimsTo(b.shape_dims(), out->mutable_shape());
}

// Protobuf's JSON errors span lines (a caret under the offending spot); ours are one line.
std::string OneLine(absl::string_view message) {
  std::string out;
  for (char c : message) {
    if (c == '\n' || c == '\r' || c == '^') {
      if (!out.empty() && out.back() != ' ') out += ' ';
    } else {
      out += c;
    }
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

}  // namespace

absl::StatusOr<Layout> LayoutFromProto(const v1::Layout& proto) {
  Layout layout;
  absl::flat_hash_map<std::string, int32_t> tensor_of;
  for (const v1::TensorSpec& t : proto.tensors()) {
    const std::string what = absl::StrCat("tensor \"", t.name(), "\"");
    REFIT_ASSIGN_OR_RETURN(Dims shape, DimsFrom(t.shape(), absl::StrCat(what, " shape")));
    auto dtype = ParseDType(t.dtype());
    if (!dtype.ok()) return Annotate(dtype.status(), what);
    const int32_t index = layout.AddTensor(t.name(), shape, *dtype);
    if (!tensor_of.emplace(t.name(), index).second) {
      return absl::InvalidArgumentError(absl::StrCat(what, " is declared twice"));
    }
  }
  for (const v1::Worker& w : proto.workers()) {
    if (w.replica_size() < 0 || w.replica_size() > kMaxReplicaSize ||
        (w.replica_size() == 0 ? !w.replica().empty() || w.replica_rank() != 0
                               : w.replica().empty() || w.replica_rank() < 0 || w.replica_rank() >= w.replica_size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "worker \"", w.name(), "\": replica \"", w.replica(), "\" rank ", w.replica_rank(), " of size ",
          w.replica_size(), " is not a rank of a replica (a name, 0 <= rank < size <= ", kMaxReplicaSize,
          "; or none of the three)"));
    }
    const int32_t worker = layout.AddWorker(w.name(), w.node(), w.gpu());
    layout.workers[worker].replica = w.replica();
    layout.workers[worker].replica_rank = w.replica_rank();
    layout.workers[worker].replica_size = w.replica_size();
    for (const v1::Buffer& b : w.buffers()) {
      const std::string where = absl::StrCat("worker \"", w.name(), "\" buffer \"", b.name(), "\"");
      REFIT_ASSIGN_OR_RETURN(Dims shape, DimsFrom(b.shape(), absl::StrCat(where, " shape")));
      auto dtype = ParseDType(b.dtype());
      if (!dtype.ok()) return Annotate(dtype.status(), where);
      const int32_t buffer = layout.AddBuffer(worker, b.name(), *dtype, shape);
      for (const v1::Piece& p : b.pieces()) {
        auto it = tensor_of.find(p.tensor());
        if (it == tensor_of.end()) {
          return absl::InvalidArgumentError(absl::StrCat(
              where, ": a piece names tensor \"", p.tensor(),
              "\", which the layout does not declare in \"tensors\""));
        }
        const std::string what = absl::StrCat(where, " piece of tensor \"", p.tensor(), "\"");
        REFIT_ASSIGN_OR_RETURN(
            Box tensor_box,
            BoxFrom(p, true, layout.tensors[it->second].shape, absl::StrCat(what, " tensor_box")));
        REFIT_ASSIGN_OR_RETURN(Box buffer_box,
                               BoxFrom(p, false, shape, absl::StrCat(what, " buffer_box")));
        layout.AddPiece(it->second, tensor_box, buffer, buffer_box);
      }
    }
  }
  return layout;
}

v1::Layout LayoutToProto(const Layout& layout, absl::string_view model) {
  v1::Layout proto;
  proto.set_model(std::string(model));
  for (const LogicalTensor& t : layout.tensors) {
    v1::TensorSpec* spec = proto.add_tensors();
    spec->set_name(t.name);
    DimsTo(t.shape, spec->mutable_shape());
    spec->set_dtype(std::string(DTypeName(t.dtype)));
  }
  std::vector<v1::Buffer*> buffers(layout.buffers.size());
  std::vector<v1::Worker*> workers;
  for (const Worker& w : layout.workers) {
    v1::Worker* out = proto.add_workers();
    out->set_name(w.name);
    out->set_node(w.node);
    out->set_gpu(w.gpu);
    out->set_replica(w.replica);
    out->set_replica_rank(w.replica_rank);
    out->set_replica_size(w.replica_size);
    workers.push_back(out);
  }
  for (size_t i = 0; i < layout.buffers.size(); ++i) {
    const Buffer& b = layout.buffers[i];
    v1::Buffer* out = workers[b.worker]->add_buffers();
    out->set_name(b.name);
    out->set_dtype(std::string(DTypeName(b.dtype)));
    DimsTo(b.shape, out->mutable_shape());
    buffers[i] = out;
  }
  for (const Piece& p : layout.pieces) {
    v1::Piece* out = buffers[p.buffer]->add_pieces();
    out->set_tensor(layout.tensors[p.tensor].name);
    BoxTo(layout.tensor_box(p), out->mutable_tensor_box());
    BoxTo(layout.buffer_box(p), out->mutable_buffer_box());
  }
  return proto;
}

absl::StatusOr<Layout> ParseLayoutJson(absl::string_view json) {
  v1::Layout proto;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &proto, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a layout in proto3 JSON: ", OneLine(status.message().as_string())));
  }
  return LayoutFromProto(proto);
}

std::string LayoutToJson(const Layout& layout, absl::string_view model) {
  // Written by hand rather than by protobuf's printer, which quotes every int64 ("4096"):
  // layout files are read by people and by jq. The parser accepts both forms.
  std::string out = absl::StrCat("{\"model\":", JsonString(model), ",\n\"tensors\":[");
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const LogicalTensor& t = layout.tensors[i];
    absl::StrAppend(&out, i ? ",\n" : "\n", "{\"name\":", JsonString(t.name),
                    ",\"shape\":", JsonArray(t.shape), ",\"dtype\":\"", DTypeName(t.dtype), "\"}");
  }
  out += "],\n\"workers\":[";
  std::vector<std::vector<int32_t>> buffers_of(layout.workers.size());
  for (size_t b = 0; b < layout.buffers.size(); ++b) {
    buffers_of[layout.buffers[b].worker].push_back(static_cast<int32_t>(b));
  }
  std::vector<std::vector<int32_t>> pieces_of(layout.buffers.size());
  for (size_t p = 0; p < layout.pieces.size(); ++p) {
    pieces_of[layout.pieces[p].buffer].push_back(static_cast<int32_t>(p));
  }
  for (size_t w = 0; w < layout.workers.size(); ++w) {
    const Worker& worker = layout.workers[w];
    absl::StrAppend(&out, w ? ",\n" : "\n", "{\"name\":", JsonString(worker.name),
                    ",\"node\":", worker.node, ",\"gpu\":", worker.gpu);
    if (!worker.replica.empty() || worker.replica_size != 0) {
      absl::StrAppend(&out, ",\"replica\":", JsonString(worker.replica), ",\"replicaRank\":",
                      worker.replica_rank, ",\"replicaSize\":", worker.replica_size);
    }
    out += ",\"buffers\":[";
    for (size_t i = 0; i < buffers_of[w].size(); ++i) {
      const int32_t b = buffers_of[w][i];
      const Buffer& buffer = layout.buffers[b];
      absl::StrAppend(&out, i ? ",\n " : "\n ", "{\"name\":", JsonString(buffer.name),
                      ",\"dtype\":\"", DTypeName(buffer.dtype), "\",\"shape\":",
                      JsonArray(buffer.shape), ",\"pieces\":[");
      for (size_t k = 0; k < pieces_of[b].size(); ++k) {
        const Piece& p = layout.pieces[pieces_of[b][k]];
        absl::StrAppend(&out, k ? ",\n  " : "\n  ", "{\"tensor\":",
                        JsonString(layout.tensors[p.tensor].name), ",\"tensorBox\":",
                        JsonBox(layout.tensor_box(p)), ",\"bufferBox\":", JsonBox(layout.buffer_box(p)),
                        "}");
      }
      out += "]}";
    }
    out += "]}";
  }
  out += "]}\n";
  return out;
}

absl::StatusOr<Topology> TopologyFromProto(const v1::Topology& proto) {
  Topology t;
  if (proto.gpus_per_node()) t.gpus_per_node = proto.gpus_per_node();
  t.nics_per_node = proto.nics_per_node() ? proto.nics_per_node() : t.gpus_per_node;
  if (proto.nvlink_gbps()) t.nvlink_gbps = proto.nvlink_gbps();
  if (proto.nic_gbps()) t.nic_gbps = proto.nic_gbps();
  if (proto.local_copy_gbps()) t.local_copy_gbps = proto.local_copy_gbps();
  if (proto.network_latency_us()) t.network_latency_us = proto.network_latency_us();
  if (proto.nvlink_latency_us()) t.nvlink_latency_us = proto.nvlink_latency_us();
  if (t.gpus_per_node < 0 || t.nics_per_node < 0 || t.nvlink_gbps < 0 || t.nic_gbps < 0 ||
      t.local_copy_gbps < 0 || t.network_latency_us < 0 || t.nvlink_latency_us < 0) {
    return absl::InvalidArgumentError("topology: every count, bandwidth and latency must be >= 0");
  }
  return t;
}

absl::StatusOr<Topology> ParseTopologyJson(absl::string_view json) {
  v1::Topology proto;
  google::protobuf::util::JsonParseOptions options;
  auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &proto, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a topology in proto3 JSON: ", OneLine(status.message().as_string())));
  }
  return TopologyFromProto(proto);
}

v1::PlanSummary SummaryToProto(const PlanStats& s, bool verified) {
  v1::PlanSummary p;
  p.set_tensors(s.tensors);
  p.set_pieces(s.pieces);
  p.set_transfers(s.transfers);
  p.set_messages(s.messages);
  p.set_descriptors(s.descriptors);
  p.set_bytes_total(s.bytes_total);
  p.set_bytes_network(s.bytes_network);
  p.set_bytes_nvlink(s.bytes_nvlink);
  p.set_bytes_local(s.bytes_local);
  p.set_bytes_forwarded(s.bytes_forwarded);
  p.set_max_nic_bytes(s.max_nic_bytes);
  p.set_predicted_seconds(s.predicted_seconds);
  p.set_lower_bound_seconds(s.lower_bound_seconds);
  p.set_planning_seconds(s.planning_seconds);
  p.set_verified(verified);
  return p;
}

std::string SummaryToJson(const PlanStats& s, bool verified) {
  // By hand, for plain JSON numbers (protobuf's printer quotes int64s).
  return absl::StrCat(
      "{\"tensors\":", s.tensors, ",\"pieces\":", s.pieces, ",\"transfers\":", s.transfers,
      ",\"messages\":", s.messages, ",\"descriptors\":", s.descriptors,
      ",\"bytes_total\":", s.bytes_total, ",\"bytes_network\":", s.bytes_network,
      ",\"bytes_nvlink\":", s.bytes_nvlink, ",\"bytes_local\":", s.bytes_local,
      ",\"bytes_forwarded\":", s.bytes_forwarded, ",\"max_nic_bytes\":", s.max_nic_bytes,
      ",\"predicted_seconds\":", absl::StrFormat("%.9g", s.predicted_seconds),
      ",\"lower_bound_seconds\":", absl::StrFormat("%.9g", s.lower_bound_seconds),
      ",\"planning_seconds\":", absl::StrFormat("%.6g", s.planning_seconds),
      ",\"verified\":", verified ? "true" : "false", "}");
}

absl::StatusOr<Layout> ReadLayoutFile(const std::string& path, absl::string_view side) {
  auto text = ReadFile(path);
  if (!text.ok()) return text.status();
  auto layout = ParseLayoutJson(*text);
  if (!layout.ok()) return Annotate(layout.status(), path);
  if (auto s = ValidateLayout(*layout, side); !s.ok()) return Annotate(s, path);
  return layout;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open \"", path, "\""));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace refit
