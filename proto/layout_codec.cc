#include "proto/layout_codec.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <sstream>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
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
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
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

std::string JsonArray(const Dims& d) {
  return absl::StrCat("[", absl::StrJoin(d.span(), ","), "]");
}

std::string JsonBox(const Box& b) {
  return absl::StrCat("{\"origin\":", JsonArray(b.origin_dims()),
                      ",\"shape\":", JsonArray(b.shape_dims()), "}");
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

absl::StatusOr<Quantization> QuantizationFrom(const v1::Quantization& q, absl::string_view name,
                                              absl::string_view what) {
  QuantFormat format;
  if (q.format() == "block_fp8") {
    format = QuantFormat::kBlockFp8;
  } else if (q.format() == "mxfp8") {
    format = QuantFormat::kMxfp8;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(what, ": quantization format \"", q.format(),
                                                   "\" is unknown (expected block_fp8 or mxfp8)"));
  }
  if (q.block_size() != 0 && q.block_size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": quantization block has ", q.block_size(), " entries; expected [rows, cols]"));
  }
  Quantization out = q.block_size() == 2 ? Quantization::Of(format, name, q.block(0), q.block(1))
                                         : Quantization::Of(format, name);
  if (format == QuantFormat::kMxfp8 && q.block_size() == 2) {
    out.block_rows = q.block(0);  // validation says MXFP8 blocks are 1x32
    out.block_cols = q.block(1);
  }
  if (!q.scale().empty()) out.scale = q.scale();
  return out;
}

void QuantizationTo(const Quantization& q, v1::TensorSpec* spec) {
  if (q.format == QuantFormat::kNone) return;
  v1::Quantization* out = spec->mutable_quantization();
  out->set_format(std::string(QuantFormatName(q.format)));
  out->add_block(q.block_rows);
  out->add_block(q.block_cols);
  out->set_scale(q.scale);
}

std::string QuantizationJson(const Quantization& q) {
  if (q.format == QuantFormat::kNone) return "";
  return absl::StrCat(",\"quantization\":{\"format\":\"", QuantFormatName(q.format),
                      "\",\"block\":[", q.block_rows, ",", q.block_cols,
                      "],\"scale\":", JsonString(q.scale), "}");
}

}  // namespace

absl::StatusOr<Layout> LayoutFromProto(const v1::Layout& proto, int64_t max_pieces) {
  Layout layout;
  absl::flat_hash_map<std::string, int32_t> tensor_of;
  for (const v1::TensorSpec& t : proto.tensors()) {
    const std::string what = absl::StrCat("tensor \"", t.name(), "\"");
    REFIT_ASSIGN_OR_RETURN(Dims shape, DimsFrom(t.shape(), absl::StrCat(what, " shape")));
    auto dtype = ParseDType(t.dtype());
    if (!dtype.ok()) return Annotate(dtype.status(), what);
    const int32_t index = layout.AddTensor(t.name(), shape, *dtype);
    if (t.has_quantization()) {
      REFIT_ASSIGN_OR_RETURN(layout.tensors[index].quant,
                             QuantizationFrom(t.quantization(), t.name(), what));
    }
    if (!tensor_of.emplace(t.name(), index).second) {
      return absl::InvalidArgumentError(absl::StrCat(what, " is declared twice"));
    }
  }
  const int64_t num_tensors = static_cast<int64_t>(layout.tensors.size());
  // Each worker's buffers and pieces are contiguous ranges (appended in order): buffers_like
  // copies an earlier worker's ranges.
  struct Ranges {
    int32_t buffer_begin, buffer_end;
    size_t piece_begin, piece_end;
  };
  std::vector<Ranges> ranges;
  absl::flat_hash_map<std::string, int32_t> worker_of;  // the first worker of each name
  auto too_many = [&](absl::string_view where, int64_t more) -> absl::Status {
    if (static_cast<int64_t>(layout.pieces.size()) + more <= max_pieces) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": the layout expands to more than ", max_pieces, " pieces"));
  };
  for (const v1::Worker& w : proto.workers()) {
    if (w.replica_size() < 0 || w.replica_size() > kMaxReplicaSize ||
        (w.replica_size() == 0 ? !w.replica().empty() || w.replica_rank() != 0
                               : w.replica().empty() || w.replica_rank() < 0 ||
                                     w.replica_rank() >= w.replica_size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("worker \"", w.name(), "\": replica \"", w.replica(), "\" rank ",
                       w.replica_rank(), " of size ", w.replica_size(),
                       " is not a rank of a replica (a name, 0 <= rank < size <= ", kMaxReplicaSize,
                       "; or none of the three)"));
    }
    const int32_t worker = layout.AddWorker(w.name(), w.node(), w.gpu());
    layout.workers[worker].replica = w.replica();
    layout.workers[worker].replica_rank = w.replica_rank();
    layout.workers[worker].replica_size = w.replica_size();
    Ranges r{static_cast<int32_t>(layout.buffers.size()), 0, layout.pieces.size(), 0};
    if (!w.buffers_like().empty()) {
      const std::string where = absl::StrCat("worker \"", w.name(), "\"");
      if (w.buffers_size() > 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, " has both buffers_like (\"", w.buffers_like(), "\") and buffers of its own"));
      }
      auto it = worker_of.find(w.buffers_like());
      if (it == worker_of.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": buffers_like names \"", w.buffers_like(),
                         "\", which is not an earlier worker of this layout"));
      }
      const Ranges& like = ranges[it->second];
      REFIT_RETURN_IF_ERROR(
          too_many(where, static_cast<int64_t>(like.piece_end - like.piece_begin)));
      for (int32_t b = like.buffer_begin; b < like.buffer_end; ++b) {
        const Buffer copy = layout.buffers[b];
        layout.AddBuffer(worker, copy.name, copy.dtype, copy.shape);
      }
      for (size_t p = like.piece_begin; p < like.piece_end; ++p) {
        Piece piece = layout.pieces[p];  // boxes are already interned: indices are shared
        piece.buffer += r.buffer_begin - like.buffer_begin;
        layout.pieces.push_back(piece);
      }
    }
    for (const v1::Buffer& b : w.buffers()) {
      const std::string where = absl::StrCat("worker \"", w.name(), "\" buffer \"", b.name(), "\"");
      REFIT_ASSIGN_OR_RETURN(Dims shape, DimsFrom(b.shape(), absl::StrCat(where, " shape")));
      auto dtype = ParseDType(b.dtype());
      if (!dtype.ok()) return Annotate(dtype.status(), where);
      const int32_t buffer = layout.AddBuffer(worker, b.name(), *dtype, shape);
      // One entry of the buffer's pieces as written: a run's steps not applied yet.
      struct Entry {
        int32_t tensor = 0;
        Box tensor_box, buffer_box;
      };
      auto decode = [&](int k) -> absl::StatusOr<Entry> {
        const v1::Piece& p = b.pieces(k);
        Entry e;
        if (p.tensor_index() != 0) {
          if (p.tensor_index() < 1 || p.tensor_index() > num_tensors) {
            return absl::InvalidArgumentError(absl::StrCat(where, " piece ", k, ": tensor_index ",
                                                           p.tensor_index(),
                                                           " is out of range (1-based; the layout "
                                                           "declares ",
                                                           num_tensors, " tensors)"));
          }
          e.tensor = p.tensor_index() - 1;
          if (!p.tensor().empty() && p.tensor() != layout.tensors[e.tensor].name) {
            return absl::InvalidArgumentError(absl::StrCat(
                where, " piece ", k, ": tensor \"", p.tensor(), "\" and tensor_index ",
                p.tensor_index(), " (\"", layout.tensors[e.tensor].name, "\") disagree"));
          }
        } else {
          auto it = tensor_of.find(p.tensor());
          if (it == tensor_of.end()) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, ": a piece names tensor \"", p.tensor(),
                             "\", which the layout does not declare in \"tensors\""));
          }
          e.tensor = it->second;
        }
        const std::string what =
            absl::StrCat(where, " piece ", k, " (tensor \"", layout.tensors[e.tensor].name, "\")");
        REFIT_ASSIGN_OR_RETURN(e.tensor_box, BoxFrom(p, true, layout.tensors[e.tensor].shape,
                                                     absl::StrCat(what, " tensor_box")));
        REFIT_ASSIGN_OR_RETURN(e.buffer_box,
                               BoxFrom(p, false, shape, absl::StrCat(what, " buffer_box")));
        return e;
      };
      auto has_run_fields = [](const v1::Piece& p) {
        return p.repeat() != 0 || p.run_pieces() != 0 || p.tensor_index_step() != 0 ||
               p.tensor_box_step_size() != 0 || p.buffer_box_step_size() != 0;
      };
      for (int k = 0; k < b.pieces_size();) {
        const v1::Piece& p = b.pieces(k);
        REFIT_ASSIGN_OR_RETURN(Entry first, decode(k));
        auto what = [&](int j) {
          return absl::StrCat(where, " piece ", j, " (tensor \"", layout.tensors[first.tensor].name,
                              "\")");
        };
        if (p.repeat() == 0) {
          if (has_run_fields(p))
            return absl::InvalidArgumentError(
                absl::StrCat(what(k), ": run fields without a repeat"));
          REFIT_RETURN_IF_ERROR(too_many(where, 1));
          layout.AddPiece(first.tensor, first.tensor_box, buffer, first.buffer_box);
          ++k;
          continue;
        }
        // A run (Piece.repeat): checked whole before any of it is added.
        if (p.repeat() < 0)
          return absl::InvalidArgumentError(absl::StrCat(what(k), ": repeat ", p.repeat(), " < 0"));
        const int group = p.run_pieces() == 0 ? 1 : p.run_pieces();
        if (group < 1 || group > b.pieces_size() - k) {
          return absl::InvalidArgumentError(absl::StrCat(what(k), ": run_pieces ", p.run_pieces(),
                                                         ", but the buffer has ",
                                                         b.pieces_size() - k, " pieces from here"));
        }
        REFIT_RETURN_IF_ERROR(too_many(where, (int64_t{p.repeat()} + 1) * group));
        std::vector<Entry> members = {first};
        for (int j = 1; j < group; ++j) {
          if (has_run_fields(b.pieces(k + j))) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, " piece ", k + j, ": one of the run of piece ", k,
                             " (run_pieces ", group, "), it may carry no run fields"));
          }
          REFIT_ASSIGN_OR_RETURN(Entry m, decode(k + j));
          members.push_back(m);
        }
        for (int j = 0; j < group; ++j) {
          const v1::Piece& q = b.pieces(k + j);
          const Entry& m = members[j];
          if (p.tensor_index_step() != 0 && q.tensor_index() == 0) {
            return absl::InvalidArgumentError(absl::StrCat(
                what(k + j),
                ": tensor_index_step needs tensor_index (a run names tensors by index)"));
          }
          const int64_t last_tensor =
              int64_t{m.tensor} + int64_t{p.repeat()} * p.tensor_index_step();
          if (last_tensor < 0 || last_tensor >= num_tensors) {
            return absl::InvalidArgumentError(
                absl::StrCat(what(k + j), ": a run of ", p.repeat() + 1, " with tensor_index_step ",
                             p.tensor_index_step(), " reaches tensor_index ", last_tensor + 1,
                             ", out of range (the layout declares ", num_tensors, " tensors)"));
          }
          for (const auto& [step, box, has, side] :
               {std::make_tuple(&p.tensor_box_step(), &m.tensor_box, q.has_tensor_box(),
                                "tensor_box"),
                std::make_tuple(&p.buffer_box_step(), &m.buffer_box, q.has_buffer_box(),
                                "buffer_box")}) {
            if (step->empty()) continue;
            if (!has || step->size() != box->rank) {
              return absl::InvalidArgumentError(
                  absl::StrCat(what(k + j), ": ", side, "_step has ", step->size(),
                               " dimensions; it needs an explicit ", side, " of as many (",
                               has ? box->rank : 0, ")"));
            }
            for (int d = 0; d < box->rank; ++d) {
              int64_t moved = 0, end = 0;
              if (__builtin_mul_overflow((*step)[d], int64_t{p.repeat()}, &moved) ||
                  __builtin_add_overflow(box->origin[d], moved, &moved) ||
                  __builtin_add_overflow(moved, box->shape[d], &end)) {
                return absl::InvalidArgumentError(absl::StrCat(what(k + j), ": ", side,
                                                               "_step overflows int64 over ",
                                                               p.repeat(), " repeats"));
              }
            }
          }
        }
        for (int64_t i = 0; i <= p.repeat(); ++i) {
          for (const Entry& m : members) {
            Box t = m.tensor_box, u = m.buffer_box;
            for (int d = 0; d < p.tensor_box_step_size(); ++d)
              t.origin[d] += i * p.tensor_box_step(d);
            for (int d = 0; d < p.buffer_box_step_size(); ++d)
              u.origin[d] += i * p.buffer_box_step(d);
            layout.AddPiece(static_cast<int32_t>(m.tensor + i * p.tensor_index_step()), t, buffer,
                            u);
          }
        }
        k += group;
      }
    }
    r.buffer_end = static_cast<int32_t>(layout.buffers.size());
    r.piece_end = layout.pieces.size();
    ranges.push_back(r);
    worker_of.emplace(w.name(), worker);
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
    QuantizationTo(t.quant, spec);
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

v1::Layout CompactLayoutToProto(const Layout& layout, absl::string_view model,
                                const CompactOptions& options) {
  v1::Layout proto;
  proto.set_model(std::string(model));
  for (const LogicalTensor& t : layout.tensors) {
    v1::TensorSpec* spec = proto.add_tensors();
    spec->set_name(t.name);
    DimsTo(t.shape, spec->mutable_shape());
    spec->set_dtype(std::string(DTypeName(t.dtype)));
    QuantizationTo(t.quant, spec);
  }
  std::vector<std::vector<int32_t>> buffers_of(layout.workers.size());
  for (size_t b = 0; b < layout.buffers.size(); ++b) {
    buffers_of[layout.buffers[b].worker].push_back(static_cast<int32_t>(b));
  }
  std::vector<std::vector<int32_t>> pieces_of(layout.buffers.size());
  for (size_t p = 0; p < layout.pieces.size(); ++p) {
    pieces_of[layout.pieces[p].buffer].push_back(static_cast<int32_t>(p));
  }
  // Two workers have the same buffers when names, dtypes, shapes and pieces (tensor and interned
  // boxes) agree, in order. Candidates by hash, confirmed by comparison.
  auto same_buffers = [&](int32_t a, int32_t b) {
    if (buffers_of[a].size() != buffers_of[b].size()) return false;
    for (size_t i = 0; i < buffers_of[a].size(); ++i) {
      const int32_t x = buffers_of[a][i], y = buffers_of[b][i];
      const Buffer &bx = layout.buffers[x], &by = layout.buffers[y];
      if (bx.name != by.name || bx.dtype != by.dtype || !(bx.shape == by.shape)) return false;
      if (pieces_of[x].size() != pieces_of[y].size()) return false;
      for (size_t k = 0; k < pieces_of[x].size(); ++k) {
        const Piece &px = layout.pieces[pieces_of[x][k]], &py = layout.pieces[pieces_of[y][k]];
        if (px.tensor != py.tensor || px.tensor_box != py.tensor_box ||
            px.buffer_box != py.buffer_box)
          return false;
      }
    }
    return true;
  };
  auto hash_buffers = [&](int32_t w) {
    size_t h = absl::HashOf(buffers_of[w].size());
    for (int32_t b : buffers_of[w]) {
      const Buffer& buffer = layout.buffers[b];
      h = absl::HashOf(h, buffer.name, static_cast<int>(buffer.dtype),
                       absl::Span<const int64_t>(buffer.shape.v.data(), buffer.shape.rank),
                       pieces_of[b].size());
      for (int32_t p : pieces_of[b]) {
        const Piece& piece = layout.pieces[p];
        h = absl::HashOf(h, piece.tensor, piece.tensor_box, piece.buffer_box);
      }
    }
    return h;
  };
  absl::flat_hash_map<size_t, std::vector<int32_t>> first_of;  // hash -> workers written in full
  for (size_t wi = 0; wi < layout.workers.size(); ++wi) {
    const int32_t w = static_cast<int32_t>(wi);
    const Worker& worker = layout.workers[w];
    v1::Worker* out = proto.add_workers();
    out->set_name(worker.name);
    out->set_node(worker.node);
    out->set_gpu(worker.gpu);
    out->set_replica(worker.replica);
    out->set_replica_rank(worker.replica_rank);
    out->set_replica_size(worker.replica_size);
    if (options.buffers_like && !buffers_of[w].empty()) {
      std::vector<int32_t>& candidates = first_of[hash_buffers(w)];
      bool like = false;
      for (int32_t c : candidates) {
        if (same_buffers(c, w)) {
          out->set_buffers_like(layout.workers[c].name);
          like = true;
          break;
        }
      }
      if (like) continue;
      candidates.push_back(w);
    }
    for (int32_t b : buffers_of[w]) {
      const Buffer& buffer = layout.buffers[b];
      v1::Buffer* ob = out->add_buffers();
      ob->set_name(buffer.name);
      ob->set_dtype(std::string(DTypeName(buffer.dtype)));
      DimsTo(buffer.shape, ob->mutable_shape());
      const std::vector<int32_t>& pieces = pieces_of[b];
      const Box whole_buffer = Box::Whole(buffer.shape);
      // What takes piece a to piece b: tensor index and box origins move, shapes stay.
      struct Steps {
        int64_t tensor = 0;
        std::array<int64_t, kMaxRank> t{}, u{};
        bool operator==(const Steps& o) const { return tensor == o.tensor && t == o.t && u == o.u; }
      };
      auto steps = [&](int32_t pa, int32_t pb, Steps* out) {
        const Piece &a = layout.pieces[pa], &b = layout.pieces[pb];
        const Box &ta = layout.tensor_box(a), &tb = layout.tensor_box(b);
        const Box &ua = layout.buffer_box(a), &ub = layout.buffer_box(b);
        if (ta.rank != tb.rank || ua.rank != ub.rank || ta.shape != tb.shape ||
            ua.shape != ub.shape)
          return false;
        if (!options.tensor_index && a.tensor != b.tensor) return false;
        *out = Steps{};
        out->tensor = int64_t{b.tensor} - a.tensor;
        for (int d = 0; d < ta.rank; ++d) out->t[d] = tb.origin[d] - ta.origin[d];
        for (int d = 0; d < ua.rank; ++d) out->u[d] = ub.origin[d] - ua.origin[d];
        return true;
      };
      const size_t n = pieces.size();
      for (size_t k = 0; k < n;) {
        // The run from here covering the most pieces: a group of `period` pieces repeated, each
        // repetition moved by the same steps (an expert-stacked buffer: (gate, up) of expert e
        // at [e, ...], then e + 1).
        size_t best_period = 1, best_repeat = 0;
        Steps best;
        for (size_t period = 1; options.runs && period <= kMaxRunPieces && k + 2 * period <= n;
             ++period) {
          Steps first;
          if (!steps(pieces[k], pieces[k + period], &first)) continue;
          size_t repeat = 0;
          while (k + (repeat + 2) * period <= n &&
                 repeat + 1 <= static_cast<size_t>(kMaxPieceRepeat)) {
            bool same = true;
            for (size_t j = 0; j < period && same; ++j) {
              Steps s;
              same = steps(pieces[k + repeat * period + j], pieces[k + (repeat + 1) * period + j],
                           &s) &&
                     s == first;
            }
            if (!same) break;
            ++repeat;
          }
          if (repeat > 0 && (repeat + 1) * period > (best_repeat + 1) * best_period) {
            best_period = period;
            best_repeat = repeat;
            best = first;
          }
        }
        const bool tmoves =
            std::any_of(best.t.begin(), best.t.end(), [](int64_t v) { return v != 0; });
        const bool bmoves =
            std::any_of(best.u.begin(), best.u.end(), [](int64_t v) { return v != 0; });
        const size_t group = best_repeat > 0 ? best_period : 1;
        for (size_t j = 0; j < group; ++j) {
          const Piece& piece = layout.pieces[pieces[k + j]];
          const Box& tbox = layout.tensor_box(piece);
          const Box& bbox = layout.buffer_box(piece);
          v1::Piece* op = ob->add_pieces();
          if (options.tensor_index) {
            op->set_tensor_index(piece.tensor + 1);
          } else {
            op->set_tensor(layout.tensors[piece.tensor].name);
          }
          // An omitted box is the whole: left out unless the run moves it.
          if (!options.omit_whole_boxes || tmoves ||
              !(tbox == Box::Whole(layout.tensors[piece.tensor].shape))) {
            BoxTo(tbox, op->mutable_tensor_box());
          }
          if (!options.omit_whole_boxes || bmoves || !(bbox == whole_buffer))
            BoxTo(bbox, op->mutable_buffer_box());
          if (j > 0 || best_repeat == 0) continue;
          op->set_repeat(static_cast<int32_t>(best_repeat));
          if (group > 1) op->set_run_pieces(static_cast<int32_t>(group));
          op->set_tensor_index_step(static_cast<int32_t>(best.tensor));
          if (tmoves)
            for (int d = 0; d < tbox.rank; ++d) op->add_tensor_box_step(best.t[d]);
          if (bmoves)
            for (int d = 0; d < bbox.rank; ++d) op->add_buffer_box_step(best.u[d]);
        }
        k += (best_repeat + 1) * group;
      }
    }
  }
  return proto;
}

absl::StatusOr<Layout> ParseLayoutJson(absl::string_view json, int64_t max_pieces) {
  v1::Layout proto;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &proto, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a layout in proto3 JSON: ", OneLine(status.message().as_string())));
  }
  return LayoutFromProto(proto, max_pieces);
}

std::string LayoutToJson(const Layout& layout, absl::string_view model) {
  // Written by hand rather than by protobuf's printer, which quotes every int64 ("4096"):
  // layout files are read by people and by jq. The parser accepts both forms.
  std::string out = absl::StrCat("{\"model\":", JsonString(model), ",\n\"tensors\":[");
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const LogicalTensor& t = layout.tensors[i];
    absl::StrAppend(&out, i ? ",\n" : "\n", "{\"name\":", JsonString(t.name),
                    ",\"shape\":", JsonArray(t.shape), ",\"dtype\":\"", DTypeName(t.dtype), "\"",
                    QuantizationJson(t.quant), "}");
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
      absl::StrAppend(&out, ",\"replica\":", JsonString(worker.replica),
                      ",\"replicaRank\":", worker.replica_rank,
                      ",\"replicaSize\":", worker.replica_size);
    }
    out += ",\"buffers\":[";
    for (size_t i = 0; i < buffers_of[w].size(); ++i) {
      const int32_t b = buffers_of[w][i];
      const Buffer& buffer = layout.buffers[b];
      absl::StrAppend(&out, i ? ",\n " : "\n ", "{\"name\":", JsonString(buffer.name),
                      ",\"dtype\":\"", DTypeName(buffer.dtype),
                      "\",\"shape\":", JsonArray(buffer.shape), ",\"pieces\":[");
      for (size_t k = 0; k < pieces_of[b].size(); ++k) {
        const Piece& p = layout.pieces[pieces_of[b][k]];
        absl::StrAppend(&out, k ? ",\n  " : "\n  ",
                        "{\"tensor\":", JsonString(layout.tensors[p.tensor].name),
                        ",\"tensorBox\":", JsonBox(layout.tensor_box(p)),
                        ",\"bufferBox\":", JsonBox(layout.buffer_box(p)), "}");
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
  p.set_bytes_before_conversion(s.bytes_before_conversion);
  p.set_bytes_gathered(s.bytes_gathered);
  p.set_scratch_bytes(s.scratch_bytes);
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
      ",\"bytes_forwarded\":", s.bytes_forwarded,
      ",\"bytes_before_conversion\":", s.bytes_before_conversion,
      ",\"bytes_gathered\":", s.bytes_gathered, ",\"scratch_bytes\":", s.scratch_bytes,
      ",\"max_nic_bytes\":", s.max_nic_bytes,
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
