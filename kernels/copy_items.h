// Copy items: a message's copy descriptors resolved to addresses, in the form the GPU kernels
// (copy_kernels.h) and their CPU twin execute. Pure C++: built and tested without a GPU.
//
// An item copies `inner` contiguous elements, repeated over up to three strided loops, from `src`
// to `dst`, converting src_dtype to dst_dtype. Packing a message writes its descriptors one after
// another into staging at the wire dtype (d.WireBytes() each); unpacking reads them back in the
// same order. The work is cut into units so that one launch balances thousands of items of any
// size: an item whose runs are long (kTileRunBytes or more) has units of one run, or a segment of
// it; an item of short runs is *tiled*: a unit is up to `segment` consecutive elements of its
// flattened index space (count[0] x count[1] x count[2] x inner, row-major), crossing run
// boundaries, so that a warp's lanes all have work and a 200-byte run is not a unit of its own
// (16.9 M units of 195 bytes made 98,883 small tensors cost 3.5x cudaMemcpy). A tiled
// item also carries the widest access all of its addresses allow (`vector`), chosen here, on the
// host, so that the kernel and its CPU twin cut the same tiles.
//
// Quantizing items (op kQuantize or kScale, plan/plan.h; the arithmetic of plan/fp8_block.h) read
// a [count[2], inner] region of a 2-D weight, rows src_stride[2] apart, cut into blocks of
// block_rows x block_cols (the last block row and column partial): one unit per block (MXFP8's
// 1 x 32 blocks: a tile of them, Mxfp8UnitRows rows of up to kMxfp8UnitCols), a block never
// split. kQuantize writes the
// block's e4m3 codes at dst, rows dst_stride[2] bytes apart; kScale writes its scale (fp32 for
// block fp8, an e8m0 byte for MXFP8) into a row-major grid at dst, block rows dst_stride[2]
// scales apart. Pack items of a message write codes (rows packed)
// or the packed grid into staging; direct items write them into the destination tensors.
// Unpacking either is a plain copy item (codes byte by byte, the grid's rows into the scale
// tensor's), as plan/host_copy.h's UnpackMessage does.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "plan/host_copy.h"
#include "plan/plan.h"

namespace refit {

// Runs shorter than this (bytes at the wider dtype) are tiled (see above). Long runs keep units of
// one run (a segment of one): a warp then streams one contiguous span, 16-byte aligned at the
// destination, which is how 16 GB of aligned tensors reach 0.935 of cudaMemcpy. 512 rather than
// the first 4096: runs of 0.5-4 KiB (TP shards' rows of small models) copy faster as runs, and
// where aligned through the aligned kernel (one H200, local_copy_bench --tile-run-bytes: Llama-3-8B
// scaled to 1 GB 0.598 -> 0.519 ms, scaled to 110 MB 0.207 -> 0.136, Qwen2.5-0.5B 0.575 -> 0.555;
// 99k small tensors the same).
inline constexpr int64_t kTileRunBytes = 512;

struct CopyItem {
  uint64_t src = 0;  // address of the first element (device or host)
  uint64_t dst = 0;
  int64_t inner = 0;                              // elements per run
  int64_t count[kMaxOuterDims] = {1, 1, 1};       // loops, outermost first (padded with 1)
  int64_t src_stride[kMaxOuterDims] = {0, 0, 0};  // in elements
  int64_t dst_stride[kMaxOuterDims] = {0, 0, 0};
  // Elements per work unit: within a run, or (tiled) of the flattened index space; quantizing:
  // block_cols (MXFP8's one-row blocks: the columns of a unit, Mxfp8UnitCols).
  int64_t segment = 0;
  int64_t segments = 0;  // work units per run (quantizing: units per block row; tiled: unused, 0)
  uint8_t src_dtype = 0;
  uint8_t dst_dtype = 0;
  uint8_t op = 0;            // CopyOp: kCopy, or quantizing (kQuantize, kScale)
  uint8_t quant_format = 0;  // QuantFormat of a quantizing item (kCopyItemMxfp8: MXFP8)
  uint16_t block_rows = 0;   // quantizing: the block
  uint16_t block_cols = 0;
  uint8_t tiled = 0;  // a copy item of short runs, units are tiles of `segment` elements
  // Tiled: the access width every element address of the item allows. Same dtype: bytes (16, 8,
  // 4, 2 or 1; may be less than an element at odd addresses); converting: elements per access
  // (8, 4, 2, 1), 0 where an element address is not a multiple of its size (byte accesses).
  uint8_t vector = 0;
  uint8_t reserved[6] = {};
  bool Quantizes() const { return op != static_cast<uint8_t>(CopyOp::kCopy); }
  // MXFP8's 1 x 32 blocks, whose units are tiles of many (the copy kernels' rows mode).
  bool Mxfp8Rows() const;
  // Rows of a quantizing item's region per work unit: a block's, or (MXFP8's 1 x 32 blocks, each
  // still scaled on its own) Mxfp8UnitRows(segment).
  int64_t RowsPerUnit() const;
  // Units down a quantizing item's region.
  int64_t UnitRowsOfRegion() const {
    const int64_t g = RowsPerUnit();
    return g == 0 ? 0 : (count[2] + g - 1) / g;
  }
  int64_t Rows() const { return count[0] * count[1] * count[2]; }
  int64_t Units() const {
    if (Quantizes()) return UnitRowsOfRegion() * segments;
    if (tiled) return segment == 0 ? 0 : (Rows() * inner + segment - 1) / segment;
    return Rows() * segments;
  }
};
static_assert(sizeof(CopyItem) == 128, "CopyItem is shared with the kernels: keep it plain");

// QuantFormat::kMxfp8 (plan/layout.h, which the kernels do not include).
inline constexpr uint8_t kCopyItemMxfp8 = 2;
// MXFP8's one-row blocks: a work unit is a tile of the region, up to kMxfp8UnitCols columns (whole
// blocks) of Mxfp8UnitRows rows, kMxfp8UnitElements elements at most: what one thread block of the
// quantizing kernel converts at once (copy_kernels.cu kTileChunks: 2048 16-byte chunks, a chunk a
// thread and row), its loads 512 contiguous bytes a warp, its codes 256, its scales 8. The units
// were columns of 64 blocks (64 rows of 32 elements, 4 KB): each warp load then touched eight rows
// 64 bytes apart, and 4 M units of the 16 GB Llama-3-8B cost their resolving (14.7 ms on an H100,
// 0.57 of the memory bound). Earlier still, one block a unit (64 bytes) and eight rows (512 bytes).
inline constexpr int64_t kMxfp8UnitElements = 16384;
inline constexpr int64_t kMxfp8UnitCols = 2048;
// The columns of an MXFP8 row item's unit for runs of `inner` elements (whole 32-element blocks,
// at most kMxfp8UnitCols), and its rows for `cols` columns.
inline int64_t Mxfp8UnitCols(int64_t inner) {
  return std::min(kMxfp8UnitCols, std::max<int64_t>(32, (inner + 31) / 32 * 32));
}
inline int64_t Mxfp8UnitRows(int64_t cols) {
  return std::max<int64_t>(1, kMxfp8UnitElements / std::max<int64_t>(cols, 1));
}

inline bool CopyItem::Mxfp8Rows() const {
  return Quantizes() && quant_format == kCopyItemMxfp8 && block_rows == 1 && block_cols == 32;
}
inline int64_t CopyItem::RowsPerUnit() const {
  return Mxfp8Rows() ? Mxfp8UnitRows(segment) : block_rows;
}

struct CopyWork {
  std::vector<CopyItem> items;
  std::vector<int64_t> unit_begin;  // items.size() + 1 prefix sums of Units()
  int64_t bytes = 0;                // staging bytes
};

// Addresses of each buffer of a layout (0 where the buffer is not here).
using BufferAddresses = std::vector<uint64_t>;
// The addresses of `memory`'s spans, in its order.
BufferAddresses AddressesOf(const BufferMemory& memory);

// Items that pack message `m` (sources from src/dst addresses as the descriptor says) into
// `staging`, or unpack `staging` into the destinations. `segment_bytes` bounds one work unit.
CopyWork PackWork(const Plan& plan, const Message& m, const BufferAddresses& src,
                  const BufferAddresses& dst, uint64_t staging, int64_t segment_bytes = 16384);
CopyWork UnpackWork(const Plan& plan, const Message& m, uint64_t staging,
                    const BufferAddresses& dst, int64_t segment_bytes = 16384);

// One descriptor's item appended to `w`: packed at staging + w.bytes, or unpacked from there
// (w.bytes then grows by its wire bytes); building blocks of the functions above.
void AppendPackItem(const CopyDescriptor& d, const BufferAddresses& src, const BufferAddresses& dst,
                    uint64_t staging, int64_t segment_bytes, CopyWork& w);
void AppendUnpackItem(const CopyDescriptor& d, uint64_t staging, const BufferAddresses& dst,
                      int64_t segment_bytes, CopyWork& w);
// Appends `more`'s items to `w` (one launch runs both).
void AppendWork(const CopyWork& more, CopyWork& w);

// Cuts a plain copy item (op kCopy; addresses, dtypes, loops and inner set) into units of at
// most `segment_bytes` (at the wider dtype): tiled when its runs are shorter than kTileRunBytes
// (with `vector` and `segment` a multiple of it), else runs or segments of runs. The functions
// above call it; tests that build items by hand too. Then Append() it.
void CutIntoUnits(CopyItem& it, int64_t segment_bytes, int64_t tile_run_bytes = kTileRunBytes);
void Append(CopyWork& w, const CopyItem& it);

// Items that copy message `m` straight from its sources to its destinations, without staging:
// for GPUs that reach each other's memory (one node, peer access).
CopyWork DirectWork(const Plan& plan, const Message& m, const BufferAddresses& src,
                    const BufferAddresses& dst, int64_t segment_bytes = 16384,
                    int64_t tile_run_bytes = kTileRunBytes);

// A kQuantize item and the kScale item of the same region (same source, blocks and format) are
// twins: the quantizing kernel writes the scales with the codes, from one read of the source, when
// the kScale item is among the kTwinWindow items after its twin (the planner lists a weight's
// codes, then its scales). The kernel's device twin of ScaleTwins must agree with this one.
inline constexpr int kTwinWindow = 8;
bool ScaleTwins(const CopyItem& quantize, const CopyItem& scale);
// Whether item i of `work` is a kScale item whose scales a twin before it writes.
bool ScalesByTwin(const CopyWork& work, size_t i);
// `work`'s unit prefix sums for a launch with the quantizing kernel (LaunchCopyItems'
// `quantizing`): no units for the items whose scales their twins write (ScalesByTwin). Their units
// would only be resolved and skipped, by both kernels: half the quantizing kernel's tasks, for
// a block fp8 or MXFP8 engine. The items stay, for the twins to find.
std::vector<int64_t> QuantizingLaunchUnits(const CopyWork& work);

// Whether every copy unit of `work` is 16-byte aligned at both ends, in whole 16 bytes (same
// dtype) or 8 elements (converting), and none is a tile: then the aligned kernel runs it
// (LaunchCopyItems' `aligned_only`).
bool AlignedOnly(const CopyWork& work);
// The same for one item; and `work` cut in two by it (the items in order within each; `work`
// must be neither output).
bool AlignedItem(const CopyItem& it);
void SplitAligned(const CopyWork& work, CopyWork& aligned, CopyWork& general);

// The CPU twin of the kernels: runs the items on host memory (addresses are host pointers);
// quantizing units through plan/host_copy.h's QuantizeRegion, one block each.
void RunCopyWorkOnHost(const CopyWork& work);

}  // namespace refit
