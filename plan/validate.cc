#include "plan/validate.h"

#include <algorithm>
#include <numeric>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace refit {
namespace {

absl::Status Invalid(absl::string_view side, std::string message) {
  return absl::InvalidArgumentError(absl::StrCat(side, " layout: ", message));
}

std::string Quote(absl::string_view s) { return absl::StrCat("\"", s, "\""); }

// Element counts and byte sizes must fit comfortably in int64 (so offsets never overflow).
bool TooLarge(const Dims& d, int element_size) {
  constexpr int64_t kLimit = int64_t{1} << 60;
  int64_t n = element_size;
  for (int i = 0; i < d.rank; ++i) {
    if (d[i] != 0 && n > kLimit / d[i]) return true;
    n *= d[i];
  }
  return false;
}

bool HasNegative(const Dims& d) {
  for (int i = 0; i < d.rank; ++i) {
    if (d[i] < 0) return true;
  }
  return false;
}

// Reports the first pair of overlapping pieces among `pieces` (all in one buffer). Sweeps along
// the dimension with the most distinct origins, so pieces stacked along any one axis cost
// O(n log n), not O(n^2).
absl::Status CheckNoOverlap(const Layout& layout, absl::string_view side,
                            std::vector<int32_t>& pieces) {
  if (pieces.size() < 2) return absl::OkStatus();
  const int rank = layout.buffer_box(layout.pieces[pieces[0]]).rank;
  int sweep = 0;
  if (rank > 1) {
    size_t best = 0;
    for (int d = 0; d < rank; ++d) {
      absl::flat_hash_set<int64_t> origins;
      for (int32_t p : pieces) origins.insert(layout.buffer_box(layout.pieces[p]).origin[d]);
      if (origins.size() > best) best = origins.size(), sweep = d;
    }
  }
  auto box = [&](int32_t p) -> const Box& { return layout.buffer_box(layout.pieces[p]); };
  if (rank == 0) {
    // A scalar buffer holds one element: two non-empty pieces in it overlap.
    std::erase_if(pieces, [&](int32_t p) { return box(p).IsEmpty(); });
    if (pieces.size() < 2) return absl::OkStatus();
    return Invalid(side,
                   absl::StrCat("pieces ", DescribePiece(layout, pieces[0]), " and ",
                                DescribePiece(layout, pieces[1]), " overlap in scalar buffer"));
  }
  std::sort(pieces.begin(), pieces.end(),
            [&](int32_t a, int32_t b) { return box(a).origin[sweep] < box(b).origin[sweep]; });
  std::vector<int32_t> active;
  for (int32_t p : pieces) {
    const Box& b = box(p);
    if (b.IsEmpty()) continue;
    std::erase_if(active, [&](int32_t q) { return box(q).end(sweep) <= b.origin[sweep]; });
    for (int32_t q : active) {
      if (Intersects(box(q), b)) {
        return Invalid(side, absl::StrCat("pieces ", DescribePiece(layout, q), " and ",
                                          DescribePiece(layout, p), " overlap at buffer box ",
                                          Intersect(box(q), b).ToString()));
      }
    }
    active.push_back(p);
  }
  return absl::OkStatus();
}

}  // namespace

std::string DescribePiece(const Layout& layout, int32_t piece) {
  const Piece& p = layout.pieces[piece];
  const Buffer& buffer = layout.buffers[p.buffer];
  return absl::StrCat("tensor ", Quote(layout.tensors[p.tensor].name), " box ",
                      layout.tensor_box(p).ToString(), " (worker ",
                      Quote(layout.workers[buffer.worker].name), " buffer ", Quote(buffer.name),
                      " box ", layout.buffer_box(p).ToString(), ")");
}

// A quantized tensor (LogicalTensor::quant): a 2-D fp8_e4m3 weight, its block shape, its scale
// tensor (declared, of the scale dtype and the block grid's shape, not quantized itself), and
// pieces that hold whole blocks: an engine loads a block with its one scale, so a piece cut
// inside a block could not be loaded (vLLM refuses such partitions too).
absl::Status CheckQuantization(const Layout& layout, absl::string_view side) {
  absl::flat_hash_map<absl::string_view, absl::string_view> scale_owner;  // scale -> its weight
  for (const LogicalTensor& t : layout.tensors) {
    const Quantization& q = t.quant;
    if (q.format == QuantFormat::kNone) continue;
    // One scale tensor per weight: two weights writing one would leave it holding whichever
    // landed last.
    if (auto [it, added] = scale_owner.emplace(q.scale, t.name); !added) {
      return Invalid(side, absl::StrCat("tensors ", Quote(it->second), " and ", Quote(t.name),
                                        " name the same scale tensor ", Quote(q.scale),
                                        "; each quantized tensor has its own"));
    }
    const std::string what =
        absl::StrCat("tensor ", Quote(t.name), " (", QuantFormatName(q.format), ")");
    if (t.dtype != DType::kF8E4M3) {
      return Invalid(
          side, absl::StrCat(what, " is ", DTypeName(t.dtype), "; a quantized tensor is fp8_e4m3"));
    }
    if (t.shape.rank != 2) {
      return Invalid(side, absl::StrCat(what, " has shape ", t.shape.ToString(),
                                        "; quantized tensors are 2-D [rows, cols] weights"));
    }
    if (q.block_rows <= 0 || q.block_cols <= 0 || q.block_rows > 4096 || q.block_cols > 4096) {
      return Invalid(side, absl::StrCat(what, " has block ", q.block_rows, "x", q.block_cols,
                                        "; each side must be in [1, 4096]"));
    }
    if (q.format == QuantFormat::kMxfp8 && (q.block_rows != 1 || q.block_cols != 32)) {
      return Invalid(side, absl::StrCat(what, " has block ", q.block_rows, "x", q.block_cols,
                                        "; MXFP8 blocks are 1x32"));
    }
    auto it = layout.tensor_index.find(q.scale);
    if (q.scale.empty() || it == layout.tensor_index.end()) {
      return Invalid(side, absl::StrCat(what, " names scale tensor ", Quote(q.scale),
                                        ", which the layout does not declare"));
    }
    const LogicalTensor& s = layout.tensors[it->second];
    const Dims grid{(t.shape[0] + q.block_rows - 1) / q.block_rows,
                    (t.shape[1] + q.block_cols - 1) / q.block_cols};
    if (s.quant.format != QuantFormat::kNone || s.dtype != q.ScaleDType() || !(s.shape == grid)) {
      return Invalid(
          side, absl::StrCat(what, ": its scale tensor ", Quote(s.name), " is ", DTypeName(s.dtype),
                             " ", s.shape.ToString(), "; expected ", DTypeName(q.ScaleDType()), " ",
                             grid.ToString(), ", not quantized itself"));
    }
  }
  for (size_t i = 0; i < layout.pieces.size(); ++i) {
    const Piece& p = layout.pieces[i];
    const LogicalTensor& t = layout.tensors[p.tensor];
    if (t.quant.format == QuantFormat::kNone) continue;
    const Box& b = layout.tensor_box(p);
    const int64_t block[2] = {t.quant.block_rows, t.quant.block_cols};
    for (int d = 0; d < 2; ++d) {
      const int64_t end = b.origin[d] + b.shape[d];
      if (b.origin[d] % block[d] != 0 || (end % block[d] != 0 && end != t.shape[d])) {
        return Invalid(
            side, absl::StrCat("piece ", DescribePiece(layout, static_cast<int32_t>(i)), " cuts a ",
                               block[0], "x", block[1], " block of quantized tensor ",
                               Quote(t.name), " (dimension ", d, " spans ", b.origin[d], ":", end,
                               "); pieces of a quantized tensor hold whole blocks"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLayout(Layout& layout, absl::string_view side) {
  layout.tensor_index.clear();
  layout.worker_index.clear();
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const LogicalTensor& t = layout.tensors[i];
    if (t.name.empty()) return Invalid(side, absl::StrCat("tensor #", i, " has no name"));
    if (HasNegative(t.shape)) {
      return Invalid(side, absl::StrCat("tensor ", Quote(t.name),
                                        " has a negative extent in shape ", t.shape.ToString()));
    }
    if (TooLarge(t.shape, DTypeSize(t.dtype))) {
      return Invalid(side, absl::StrCat("tensor ", Quote(t.name), " of shape ", t.shape.ToString(),
                                        " is too large (over 2^60 bytes)"));
    }
    if (!layout.tensor_index.emplace(t.name, static_cast<int32_t>(i)).second) {
      return Invalid(side, absl::StrCat("tensor ", Quote(t.name), " is declared twice"));
    }
  }
  for (size_t i = 0; i < layout.workers.size(); ++i) {
    const Worker& w = layout.workers[i];
    if (w.name.empty()) return Invalid(side, absl::StrCat("worker #", i, " has no name"));
    if (w.node < 0 || w.gpu < 0) {
      return Invalid(side, absl::StrCat("worker ", Quote(w.name), " has node ", w.node, " and gpu ",
                                        w.gpu, "; both must be >= 0"));
    }
    if (!layout.worker_index.emplace(w.name, static_cast<int32_t>(i)).second) {
      return Invalid(side, absl::StrCat("worker ", Quote(w.name), " is declared twice"));
    }
  }
  absl::flat_hash_set<std::pair<int32_t, std::string>> buffer_names;
  for (size_t i = 0; i < layout.buffers.size(); ++i) {
    const Buffer& b = layout.buffers[i];
    if (b.worker < 0 || b.worker >= static_cast<int32_t>(layout.workers.size())) {
      return Invalid(side, absl::StrCat("buffer ", Quote(b.name), " refers to worker #", b.worker,
                                        ", which does not exist"));
    }
    const std::string& wname = layout.workers[b.worker].name;
    if (b.name.empty()) {
      return Invalid(side, absl::StrCat("worker ", Quote(wname), " has a buffer with no name"));
    }
    if (HasNegative(b.shape)) {
      return Invalid(side, absl::StrCat("worker ", Quote(wname), " buffer ", Quote(b.name),
                                        " has a negative extent in shape ", b.shape.ToString()));
    }
    if (TooLarge(b.shape, DTypeSize(b.dtype))) {
      return Invalid(side,
                     absl::StrCat("worker ", Quote(wname), " buffer ", Quote(b.name), " of shape ",
                                  b.shape.ToString(), " is too large (over 2^60 bytes)"));
    }
    if (!buffer_names.emplace(b.worker, b.name).second) {
      return Invalid(side, absl::StrCat("worker ", Quote(wname), " declares buffer ", Quote(b.name),
                                        " twice"));
    }
  }

  std::vector<std::vector<int32_t>> pieces_of_buffer(layout.buffers.size());
  for (size_t i = 0; i < layout.pieces.size(); ++i) {
    const Piece& p = layout.pieces[i];
    if (p.buffer < 0 || p.buffer >= static_cast<int32_t>(layout.buffers.size())) {
      return Invalid(side, absl::StrCat("piece #", i, " refers to buffer #", p.buffer,
                                        ", which does not exist"));
    }
    const Buffer& buffer = layout.buffers[p.buffer];
    const std::string where = absl::StrCat("worker ", Quote(layout.workers[buffer.worker].name),
                                           " buffer ", Quote(buffer.name));
    if (p.tensor < 0 || p.tensor >= static_cast<int32_t>(layout.tensors.size())) {
      return Invalid(side, absl::StrCat(where, ": a piece refers to tensor #", p.tensor,
                                        ", which is not declared"));
    }
    const LogicalTensor& t = layout.tensors[p.tensor];
    const int32_t num_boxes = static_cast<int32_t>(layout.boxes.size());
    if (p.tensor_box < 0 || p.tensor_box >= num_boxes || p.buffer_box < 0 ||
        p.buffer_box >= num_boxes) {
      return Invalid(side, absl::StrCat(where, ": a piece of tensor ", Quote(t.name),
                                        " refers to a box that does not exist"));
    }
    const Box& tensor_box = layout.tensor_box(p);
    const Box& buffer_box = layout.buffer_box(p);
    const std::string what = absl::StrCat(where, ": piece of tensor ", Quote(t.name));
    if (tensor_box.rank != t.shape.rank) {
      return Invalid(side, absl::StrCat(what, " has a box of rank ", tensor_box.rank,
                                        " but the tensor has rank ", t.shape.rank, " (shape ",
                                        t.shape.ToString(), ")"));
    }
    if (!Contains(Box::Whole(t.shape), tensor_box) || HasNegative(tensor_box.shape_dims()) ||
        HasNegative(tensor_box.origin_dims())) {
      return Invalid(side, absl::StrCat(what, " box ", tensor_box.ToString(),
                                        " lies outside the tensor's shape ", t.shape.ToString()));
    }
    if (buffer_box.rank != buffer.shape.rank) {
      return Invalid(side, absl::StrCat(what, " has a buffer box ", buffer_box.ToString(),
                                        " of rank ", buffer_box.rank, " but the buffer has shape ",
                                        buffer.shape.ToString()));
    }
    if (!Contains(Box::Whole(buffer.shape), buffer_box) || HasNegative(buffer_box.shape_dims()) ||
        HasNegative(buffer_box.origin_dims())) {
      return Invalid(side,
                     absl::StrCat(what, " buffer box ", buffer_box.ToString(),
                                  " lies outside the buffer's shape ", buffer.shape.ToString()));
    }
    if (buffer.dtype != t.dtype) {
      return Invalid(side, absl::StrCat(what, ": the buffer holds ", DTypeName(buffer.dtype),
                                        " but the tensor is ", DTypeName(t.dtype)));
    }
    auto view = ViewOf(tensor_box, buffer_box, buffer.shape);
    if (!view.ok()) return Invalid(side, absl::StrCat(what, ": ", view.status().message()));
    pieces_of_buffer[p.buffer].push_back(static_cast<int32_t>(i));
  }
  for (auto& pieces : pieces_of_buffer) {
    if (auto s = CheckNoOverlap(layout, side, pieces); !s.ok()) return s;
  }
  return CheckQuantization(layout, side);
}

absl::Status ValidatePair(const Layout& source, const Layout& destination) {
  // Scale tensors the data plane computes: those of destination tensors quantized on the way.
  absl::flat_hash_set<absl::string_view> computed_scales;
  for (const LogicalTensor& d : destination.tensors) {
    if (d.quant.format == QuantFormat::kNone) continue;
    auto it = source.tensor_index.find(d.name);
    if (it != source.tensor_index.end() && CanQuantizeFrom(source.tensors[it->second].dtype)) {
      computed_scales.insert(d.quant.scale);
    }
  }
  for (const LogicalTensor& d : destination.tensors) {
    if (computed_scales.contains(d.name)) {
      if (source.tensor_index.contains(d.name)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor ", Quote(d.name), " is the scale of a tensor the destination quantizes from ",
            "the source's values, but the source layout declares it too; drop one of the two"));
      }
      continue;
    }
    auto it = source.tensor_index.find(d.name);
    if (it == source.tensor_index.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("destination layout: tensor ", Quote(d.name),
                       " is unknown to the source layout (no trainer declares it)"));
    }
    const LogicalTensor& s = source.tensors[it->second];
    if (!(s.shape == d.shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", Quote(d.name), " has shape ", s.shape.ToString(), " in the source layout but ",
          d.shape.ToString(), " in the destination layout"));
    }
    if (d.quant.format != QuantFormat::kNone && CanQuantizeFrom(s.dtype)) continue;
    if (d.quant.format != QuantFormat::kNone && !(s.quant == d.quant)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", Quote(d.name), " is ", QuantFormatName(d.quant.format),
                       " in the destination layout; the source's ", DTypeName(s.dtype), " ",
                       QuantFormatName(s.quant.format),
                       " tensor can be neither quantized (only bf16, fp16 and fp32 are) nor copied "
                       "(its quantization differs)"));
    }
    if (!CanConvert(s.dtype, d.dtype)) {
      const bool to_fp8 = d.dtype == DType::kF8E4M3 && CanQuantizeFrom(s.dtype);
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", Quote(d.name), " is ", DTypeName(s.dtype), " in the source layout but ",
          DTypeName(d.dtype), " in the destination layout; only bf16, fp16 and fp32 convert",
          to_fp8 ? " element by element; to quantize into fp8, declare the destination tensor's "
                   "quantization (block_fp8 or mxfp8) and its scale tensor (docs/LAYOUTS.md)"
                 : ""));
    }
  }
  return absl::OkStatus();
}

}  // namespace refit
