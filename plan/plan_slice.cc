#include "plan/plan_slice.h"

#include "absl/strings/str_cat.h"

namespace refit {

bool TouchesNode(const Plan& plan, const Message& m, int32_t node) {
  return plan.gpus[m.src_gpu].node == node || plan.gpus[m.dst_gpu].node == node;
}

Plan SliceOfPlan(const Plan& plan, int32_t node, int64_t keep_remote_min_bytes) {
  Plan slice;
  slice.gpus = plan.gpus;
  slice.scratch = plan.scratch;
  slice.first_scratch_buffer = plan.first_scratch_buffer;
  slice.stats = plan.stats;
  slice.messages = plan.messages;
  for (Message& m : slice.messages) {
    const Message original = m;
    const bool local = TouchesNode(plan, original, node);
    const bool network = plan.gpus[m.src_gpu].node != plan.gpus[m.dst_gpu].node;
    m.first_descriptor = static_cast<int64_t>(slice.descriptors.size());
    // A descriptor of keep_remote_min_bytes needs a message at least that large.
    const bool keeps_some =
        local || (network && keep_remote_min_bytes > 0 && m.bytes >= keep_remote_min_bytes);
    for (int64_t k = 0; keeps_some && k < original.num_descriptors; ++k) {
      const CopyDescriptor& d = plan.descriptor(original, k);
      if (local || d.WireBytes() >= keep_remote_min_bytes) {  // keeps_some checked the rest
        slice.descriptors.push_back(d);
      }
    }
    m.num_descriptors = static_cast<int64_t>(slice.descriptors.size()) - m.first_descriptor;
  }
  slice.message_descriptors.resize(slice.descriptors.size());
  for (size_t i = 0; i < slice.descriptors.size(); ++i)
    slice.message_descriptors[i] = static_cast<int32_t>(i);
  return slice;
}

namespace {

// One past the last element a descriptor reaches on one side, or an error for negative values.
absl::StatusOr<int64_t> Extent(const CopyDescriptor& d, bool dst_side) {
  const int64_t offset = dst_side ? d.dst_offset : d.src_offset;
  const auto& stride = dst_side ? d.dst_stride : d.src_stride;
  if (offset < 0 || d.inner < 0) return absl::InvalidArgumentError("a negative offset or run");
  if (d.outer_rank > kMaxOuterDims)
    return absl::InvalidArgumentError("more outer loops than a descriptor has");
  int64_t inner = d.inner;
  std::array<int64_t, kMaxOuterDims> count{};
  for (int i = 0; i < kMaxOuterDims; ++i) count[i] = d.count[i];
  if (dst_side && d.op == CopyOp::kScale) {  // one scale per block: a grid of blocks
    if (d.block_rows == 0 || d.block_cols == 0 || d.outer_rank != 1) {
      return absl::InvalidArgumentError(
          "a scale descriptor without its block or with other than one outer loop");
    }
    count[0] = (count[0] + d.block_rows - 1) / d.block_rows;
    inner = (inner + d.block_cols - 1) / d.block_cols;
  }
  if (inner == 0) return offset;
  int64_t last = offset + inner;
  for (int i = 0; i < d.outer_rank; ++i) {
    if (count[i] < 0 || stride[i] < 0)
      return absl::InvalidArgumentError("a negative count or stride");
    if (count[i] == 0) return offset;
    if (stride[i] > 0 && count[i] - 1 > (INT64_MAX - last) / stride[i]) {
      return absl::InvalidArgumentError("an extent that overflows");
    }
    last += (count[i] - 1) * stride[i];
  }
  return last;
}

}  // namespace

absl::Status CheckSlice(const Plan& slice, int32_t node, const Layout& src, const Layout& dst) {
  const int64_t gpus = static_cast<int64_t>(slice.gpus.size());
  const int64_t dst_buffers = static_cast<int64_t>(dst.buffers.size());
  if (slice.first_scratch_buffer != dst_buffers) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan slice: scratch buffers begin at ", slice.first_scratch_buffer,
                     ", the destination layout has ", dst_buffers, " buffers"));
  }
  for (const ScratchBuffer& s : slice.scratch) {
    if (s.gpu < 0 || s.gpu >= gpus || s.worker < 0 ||
        s.worker >= static_cast<int64_t>(dst.workers.size()) || s.elements < 0) {
      return absl::InvalidArgumentError(
          "plan slice: a scratch buffer names a GPU or worker out of range");
    }
  }
  if (slice.message_descriptors.size() != slice.descriptors.size()) {
    return absl::InvalidArgumentError(
        "plan slice: the descriptor index does not match the descriptors");
  }
  int64_t next = 0;
  for (size_t i = 0; i < slice.messages.size(); ++i) {
    const Message& m = slice.messages[i];
    if (m.src_gpu < 0 || m.src_gpu >= gpus || m.dst_gpu < 0 || m.dst_gpu >= gpus ||
        m.stage >= kMaxStages || m.bytes < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan slice: message ", i, " names a GPU or stage out of range"));
    }
    if (m.first_descriptor != next || m.num_descriptors < 0 ||
        m.num_descriptors > static_cast<int64_t>(slice.descriptors.size()) - next) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan slice: message ", i, "'s descriptors are not where the headers say"));
    }
    next += m.num_descriptors;
    const bool reads_here = slice.gpus[m.src_gpu].node == node;
    const bool writes_here = slice.gpus[m.dst_gpu].node == node;
    for (int64_t k = 0; k < m.num_descriptors; ++k) {
      const int64_t index = slice.message_descriptors[m.first_descriptor + k];
      if (index < 0 || index >= static_cast<int64_t>(slice.descriptors.size())) {
        return absl::InvalidArgumentError(
            absl::StrCat("plan slice: message ", i, " names descriptor ", index));
      }
      const CopyDescriptor& d = slice.descriptors[index];
      if (d.message != static_cast<int32_t>(i)) {
        return absl::InvalidArgumentError(absl::StrCat("plan slice: descriptor ", index,
                                                       " of message ", i,
                                                       " says it belongs to message ", d.message));
      }
      // The elements a side of this node may reach: its buffer's, where the buffer is here.
      auto room = [&](bool dst_side) -> absl::StatusOr<int64_t> {
        const int32_t b = dst_side ? d.dst_buffer : d.src_buffer;
        const bool in_destination = dst_side || d.src_is_destination;
        const int32_t gpu = dst_side ? m.dst_gpu : m.src_gpu;
        if (in_destination && b >= dst_buffers &&
            b - dst_buffers < static_cast<int64_t>(slice.scratch.size())) {
          const ScratchBuffer& s = slice.scratch[b - dst_buffers];
          if (s.gpu != gpu)
            return absl::InvalidArgumentError(
                absl::StrCat("scratch buffer ", b, " is on another GPU"));
          return s.elements;
        }
        const Layout& l = in_destination ? dst : src;
        if (b < 0 || b >= static_cast<int64_t>(l.buffers.size())) {
          return absl::InvalidArgumentError(absl::StrCat("buffer ", b, " is out of range"));
        }
        const Buffer& buffer = l.buffers[b];
        if (buffer.worker < 0 || buffer.worker >= static_cast<int64_t>(l.workers.size()) ||
            l.workers[buffer.worker].node != node ||
            slice.gpus[gpu].gpu != l.workers[buffer.worker].gpu) {
          return absl::InvalidArgumentError(absl::StrCat("buffer ", b, " (\"", buffer.name,
                                                         "\") is not on GPU ", slice.gpus[gpu].gpu,
                                                         " of node ", node));
        }
        return buffer.shape.NumElements();
      };
      for (const bool dst_side : {false, true}) {
        if (!(dst_side ? writes_here : reads_here)) continue;
        auto extent = Extent(d, dst_side);
        absl::StatusOr<int64_t> elements = extent.ok() ? room(dst_side) : extent.status();
        if (elements.ok() && *extent > *elements) {
          elements = absl::InvalidArgumentError(
              absl::StrCat("it reaches element ", *extent, " of a buffer of ", *elements));
        }
        if (!elements.ok()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "plan slice: descriptor ", index, " of message ", i, " (",
              dst_side ? "destination" : "source", " side): ", elements.status().message()));
        }
      }
    }
  }
  if (next != static_cast<int64_t>(slice.descriptors.size())) {
    return absl::InvalidArgumentError("plan slice: descriptors that no message carries");
  }
  return absl::OkStatus();
}

}  // namespace refit
