// The colocated refit's copy kernel alone, on the layouts a refit runs: where the
// transfer phase's time goes when every message stays on one GPU. Plans --src into --dst (every
// worker on GPU 0), allocates every buffer with cudaMalloc, builds the direct work of each stage
// as the cuda backend does (DirectWork), and times one launch per stage, warm (medians of
// --repeat after 3 warm-up runs), against cudaMemcpyAsync of the same bytes in the same run; per
// --segments value (bytes per work unit: a tile of short runs, or a run's segment) and --spread
// value (the unit order: auto is SpreadPays, as the cuda backend launches; 0 or 1 forces it);
// with --aligned-kernel 1 aligned work goes through the aligned kernel (refitd
// --aligned-copy-kernel), with 0 through the general one. One JSON line per case.
// --tile-run-bytes: runs shorter than this are tiled (kTileRunBytes as refitd runs); --split 1:
// a stage's aligned items through the aligned kernel and the rest through the general one, two
// launches (0: one launch, the aligned kernel only where every item allows it; 2 and 3: only the
// aligned launch, or only the general one, timed alone against the bound of its own traffic).
// --batch-caps, --fill-warps, --blocks-per-sm: the launch's shape (CopyLaunchShape; batch cap 0:
// the kernel's default; blocks at most this many times the SMs, 0 for LaunchCopyItems' cap).
//   local_copy_bench --src t.json --dst i.json [--repeat 10] [--segments 16384,65536,262144]
//   [--spread auto,0,1]
//                    [--aligned-kernel 1] [--tile-run-bytes 512] [--split 0,1] [--batch-caps
//                    32,8,4]
//                    [--fill-warps 8192,2048] [--blocks-per-sm 0,1,2,3] [--quantizing auto,0]
//                    [--quant-min-blocks 2,3] [--plain 1,0]
// --quantizing: quantizing items in the quantizing kernel (auto: where a launch has any, as
// HasQuantizing; 0: in the copy kernel, as before it); --quant-min-blocks: its register plan;
// --plain: launches without quantizing units through the copy kernel without quantizing code (1,
// as refitd launches them) or with it (0).
// --fill refit: the sources hold what the refit's workers fill them with (FillAsWorkers: blocks
// of zeros among the quantized weights) rather than weight-like values everywhere (weights).
// Each line also gives the bytes the launches must read and write (a quantized weight's source
// once, its codes and scales; a copy's both ends) and the time that traffic takes at the rate of
// the device-to-device copy of the same run (which reads and writes `bytes`): the memory bound.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/copy_items.h"
#include "kernels/copy_kernels.h"
#include "kernels/cuda_check.h"
#include "plan/planner.h"
#include "plan/verify.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {

float TimeMs(cudaStream_t s, const std::function<void()>& fn) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a, s);
  fn();
  cudaEventRecord(b, s);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Options {
  int repeat = 10;
  std::vector<int64_t> segments = {16384};
  std::vector<int> spreads = {-1};  // auto
  bool aligned_kernel = true;
  std::vector<int64_t> tile_run_bytes = {kTileRunBytes};
  std::vector<int> splits = {0};
  // The launch's shape (CopyLaunchShape): batch caps (0: each kernel's default), warps to fill,
  // blocks at most this many per SM (0: LaunchCopyItems' cap of 4096).
  std::vector<int64_t> batch_caps = {0}, fill_warps = {8192}, blocks_per_sm = {0};
  std::vector<int> quantizing = {-1};  // -1: auto (HasQuantizing), 0: never
  // Launches without quantizing units: 1 through the copy kernel without quantizing code
  // (QuantizingUnits::kNone, as refitd launches them), 0 through the one with it.
  std::vector<int> plains = {1};
  std::vector<int64_t> quant_min_blocks = {2};
  bool fill_refit = false;  // --fill refit: FillAsWorkers; weights (default): FillBf16Weights
};

// Bytes an item must read and write at least: a kScale item's source is its kQuantize item's.
void ItemTraffic(const CopyItem& it, int64_t* read, int64_t* written) {
  const int ss = DTypeSize(static_cast<DType>(it.src_dtype)),
            ds = DTypeSize(static_cast<DType>(it.dst_dtype));
  if (it.op == static_cast<uint8_t>(CopyOp::kScale)) {
    *written += (it.count[2] + it.block_rows - 1) / it.block_rows *
                ((it.inner + it.block_cols - 1) / it.block_cols) * ds;
    return;
  }
  const int64_t elements = it.Rows() * it.inner;
  *read += elements * ss;
  *written += elements * ds;
}

// The sources as the refit's trainer workers fill them (plan/verify.h, version 1: what
// tests/gpu/colocated_bench.sh's rounds carry), so that the kernels run on the values refitd
// meets there: quantized weights with one block of zeros in eleven, others with raw bits.
void FillAsWorkers(const Layout& src, const Layout& dst,
                   const std::vector<std::unique_ptr<DeviceBuffer>>& device) {
  std::vector<std::vector<std::byte>> host(src.buffers.size());
  BufferMemory memory;
  for (size_t i = 0; i < src.buffers.size(); ++i) {
    host[i].resize(src.buffers[i].NumBytes());
    memory.emplace_back(host[i].data(), host[i].size());
  }
  FillSources(src, MakeFillSpec(src, dst, 1), memory);
  for (size_t i = 0; i < host.size(); ++i) {
    REFIT_CUDA_CHECK(
        cudaMemcpy(device[i]->get(), host[i].data(), host[i].size(), cudaMemcpyHostToDevice));
  }
}

int Run(const std::string& src_path, const std::string& dst_path, const Options& o) {
  auto src = ReadLayoutFile(src_path, "source");
  auto dst = ReadLayoutFile(dst_path, "destination");
  if (!src.ok() || !dst.ok()) {
    std::fprintf(stderr, "%s\n",
                 std::string((src.ok() ? dst.status() : src.status()).message()).c_str());
    return 2;
  }
  PlanOptions options;
  options.topology.gpus_per_node = 1;
  auto plan = MakePlan(*src, *dst, options);
  if (!plan.ok()) {
    std::fprintf(stderr, "%s\n", std::string(plan.status().message()).c_str());
    return 2;
  }
  std::vector<std::unique_ptr<DeviceBuffer>> owners;
  BufferAddresses sa, da;
  for (const Buffer& b : src->buffers) {
    owners.push_back(std::make_unique<DeviceBuffer>(b.NumBytes()));
    sa.push_back(owners.back()->address());
    // Weight-like values: quantizing's cost depends on them (zeros, what a fresh allocation
    // holds, would time a case no refit meets).
    if (!o.fill_refit) {
      REFIT_CUDA_CHECK(FillBf16Weights(owners.back()->get(), b.NumBytes(), sa.size(), nullptr));
    }
  }
  if (o.fill_refit) FillAsWorkers(*src, *dst, owners);
  REFIT_CUDA_CHECK(cudaDeviceSynchronize());
  for (const Buffer& b : dst->buffers)
    owners.push_back(std::make_unique<DeviceBuffer>(b.NumBytes())),
        da.push_back(owners.back()->address());
  for (const ScratchBuffer& b : plan->scratch)
    owners.push_back(std::make_unique<DeviceBuffer>(b.NumBytes())),
        da.push_back(owners.back()->address());
  int64_t bytes = plan->stats.bytes_total;
  DeviceBuffer a(static_cast<size_t>(bytes)), b(static_cast<size_t>(bytes));
  cudaStream_t stream;
  REFIT_CUDA_CHECK(cudaStreamCreate(&stream));
  int sms = 0;
  REFIT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int64_t segment : o.segments) {
    for (int spread : o.spreads) {
      for (int64_t tile_run : o.tile_run_bytes) {
        for (int split : o.splits) {
          // One work list per stage, every message of it (all local here); with --split 1, a
          // stage's aligned items in one launch of the aligned kernel and the rest in one of the
          // general.
          struct Launch {
            // begin_q: the units with the quantizing kernel (QuantizingLaunchUnits), units_q of
            // them.
            std::unique_ptr<DeviceBuffer> items, begin, begin_q;
            int n = 0;
            int64_t units = 0, units_q = 0, tiled_units = 0;
            bool spread = false;  // as the cuda backend launches it (SpreadPays), unless --spread
            bool aligned =
                false;  // AlignedOnly: the aligned kernel, as the cuda backend launches it
            bool has_quantizing = false;
            QuantizingUnits quantizing_units = QuantizingUnits::kNone;  // QuantizingUnitsOf
          };
          int64_t read_bytes = 0, written_bytes = 0;
          std::vector<Launch> launches;
          auto add = [&](const CopyWork& w) {
            if (w.items.empty()) return;
            Launch& st = launches.emplace_back();
            st.items = std::make_unique<DeviceBuffer>(w.items.size() * sizeof(CopyItem));
            st.begin = std::make_unique<DeviceBuffer>(w.unit_begin.size() * sizeof(int64_t));
            REFIT_CUDA_CHECK(cudaMemcpy(st.items->get(), w.items.data(), st.items->size(),
                                        cudaMemcpyHostToDevice));
            REFIT_CUDA_CHECK(cudaMemcpy(st.begin->get(), w.unit_begin.data(), st.begin->size(),
                                        cudaMemcpyHostToDevice));
            const std::vector<int64_t> begin_q = QuantizingLaunchUnits(w);
            st.begin_q = std::make_unique<DeviceBuffer>(begin_q.size() * sizeof(int64_t));
            REFIT_CUDA_CHECK(cudaMemcpy(st.begin_q->get(), begin_q.data(), st.begin_q->size(),
                                        cudaMemcpyHostToDevice));
            st.n = static_cast<int>(w.items.size());
            st.units = w.unit_begin.back();
            st.units_q = begin_q.back();
            st.spread = spread < 0 ? SpreadPays(w) : spread == 1;
            st.aligned = o.aligned_kernel && AlignedOnly(w);
            st.has_quantizing = HasQuantizing(w);
            st.quantizing_units = QuantizingUnitsOf(w);
            for (const CopyItem& it : w.items) {
              st.tiled_units += it.tiled ? it.Units() : 0;
              ItemTraffic(it, &read_bytes, &written_bytes);
            }
          };
          for (int s = 0; s < kMaxStages; ++s) {
            CopyWork w;
            w.unit_begin.push_back(0);
            for (const Message& m : plan->messages) {
              if (m.stage == s) AppendWork(DirectWork(*plan, m, sa, da, segment, tile_run), w);
            }
            if (split == 0) {
              add(w);
              continue;
            }
            CopyWork aligned, general;
            SplitAligned(w, aligned, general);
            if (split != 3) add(aligned);  // --split 2: the aligned launch alone, 3: the general
            if (split != 2) add(general);
          }
          int64_t units = 0, items = 0, tiled_units = 0;
          bool spread_used = false, aligned_used = false;
          for (const Launch& st : launches)
            units += st.units, items += st.n, tiled_units += st.tiled_units,
                spread_used |= st.spread, aligned_used |= st.aligned;
          for (int64_t batch_cap : o.batch_caps) {
            for (int64_t fill : o.fill_warps) {
              for (int64_t per_sm : o.blocks_per_sm) {
                for (int quantizing : o.quantizing) {
                  for (int plain : o.plains) {
                    for (int64_t quant_min_blocks : o.quant_min_blocks) {
                      auto shape_of = [&](const Launch& st) {
                        CopyLaunchShape shape = DefaultCopyLaunchShape(st.aligned);
                        if (batch_cap > 0) shape.max_batch = static_cast<int>(batch_cap);
                        shape.warps_to_fill = fill;
                        if (per_sm > 0) shape.max_blocks = static_cast<int>(per_sm * sms);
                        shape.quant_min_blocks = static_cast<int>(quant_min_blocks);
                        return shape;
                      };
                      std::vector<float> tk, tc;
                      float bound_ms = 0;
                      for (int r = 0; r < o.repeat + 3; ++r) {
                        const float k = TimeMs(stream, [&] {
                          for (const Launch& st : launches) {
                            const bool q = quantizing != 0 && st.has_quantizing;
                            REFIT_CUDA_CHECK(LaunchCopyItemsShaped(
                                static_cast<CopyItem*>(st.items->get()),
                                static_cast<int64_t*>((q ? st.begin_q : st.begin)->get()), st.n,
                                q ? st.units_q : st.units, stream, st.spread, st.aligned,
                                shape_of(st), nullptr, 0,
                                q                             ? st.quantizing_units
                                : !st.has_quantizing && plain ? QuantizingUnits::kNone
                                                              : QuantizingUnits::kInCopyKernel));
                          }
                        });
                        const float c = TimeMs(stream, [&] {
                          REFIT_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(),
                                                           static_cast<size_t>(bytes),
                                                           cudaMemcpyDeviceToDevice, stream));
                        });
                        if (r >= 3) tk.push_back(k), tc.push_back(c);
                      }
                      // The copy read and wrote `bytes` in Median(tc): the same rate for the
                      // launches' traffic.
                      bound_ms =
                          static_cast<float>(static_cast<double>(read_bytes + written_bytes) /
                                             (2.0 * bytes) * Median(tc));
                      std::printf(
                          "{\"bench\":\"local_copy_kernel\",\"src\":\"%s\",\"bytes\":%lld,"
                          "\"items\":%"
                          "lld,"
                          "\"units\":%lld,"
                          "\"tiled_units\":%lld,\"segment_bytes\":%lld,\"tile_run_bytes\":%lld,"
                          "\"split\":%d,"
                          "\"launches\":%zu,"
                          "\"spread\":\"%s\",\"aligned_kernel\":%s,\"batch_cap\":%lld,\"fill_"
                          "warps\":"
                          "%lld,"
                          "\"blocks_per_sm\":%lld,\"quantizing\":\"%s\",\"plain\":%d,\"quant_min_"
                          "blocks\":%lld,"
                          "\"fill\":\"%s\","
                          "\"runs\":%"
                          "d,\"kernel_ms\":%.4f,"
                          "\"memcpy_d2d_ms\":%.4f,\"kernel_vs_memcpy\":%.3f,\"read_bytes\":%lld,"
                          "\"written_"
                          "bytes\":%lld,"
                          "\"traffic_bound_ms\":%.4f,\"of_traffic_bound\":%.3f}\n",
                          src_path.c_str(), (long long)bytes, (long long)items, (long long)units,
                          (long long)tiled_units, (long long)segment, (long long)tile_run, split,
                          launches.size(),
                          spread < 0 ? (spread_used ? "auto:1" : "auto:0") : (spread ? "1" : "0"),
                          aligned_used ? "true" : "false", (long long)batch_cap, (long long)fill,
                          (long long)per_sm, quantizing != 0 ? "auto" : "0", plain,
                          (long long)quant_min_blocks, o.fill_refit ? "refit" : "weights", o.repeat,
                          Median(tk), Median(tc), Median(tc) / Median(tk), (long long)read_bytes,
                          (long long)written_bytes, bound_ms, bound_ms / Median(tk));
                      std::fflush(stdout);
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  std::string src, dst;
  refit::Options o;
  auto list = [](const std::string& value) {
    std::vector<int64_t> out;
    for (absl::string_view s : absl::StrSplit(value, ',')) {
      int64_t v = 0;
      if (absl::SimpleAtoi(s, &v) && v >= 0) out.push_back(v);
    }
    return out;
  };
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--src")
      src = value;
    else if (flag == "--dst")
      dst = value;
    else if (flag == "--repeat")
      o.repeat = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--segments")
      o.segments = list(value);
    else if (flag == "--tile-run-bytes")
      o.tile_run_bytes = list(value);
    else if (flag == "--batch-caps")
      o.batch_caps = list(value);
    else if (flag == "--fill-warps")
      o.fill_warps = list(value);
    else if (flag == "--blocks-per-sm")
      o.blocks_per_sm = list(value);
    else if (flag == "--quant-min-blocks")
      o.quant_min_blocks = list(value);
    else if (flag == "--fill") {
      if (value != "refit" && value != "weights") {
        std::fprintf(stderr, "--fill must be refit or weights, not \"%s\"\n", value.c_str());
        return 2;
      }
      o.fill_refit = value == "refit";
    } else if (flag == "--quantizing") {
      o.quantizing.clear();
      for (absl::string_view s : absl::StrSplit(value, ','))
        o.quantizing.push_back(s == "0" ? 0 : -1);
    } else if (flag == "--plain") {
      o.plains.clear();
      for (int64_t v : list(value)) o.plains.push_back(v != 0);
    } else if (flag == "--split") {
      o.splits.clear();
      for (int64_t v : list(value)) {
        if (v < 0 || v > 3) {
          std::fprintf(stderr, "--split values are 0, 1, 2 or 3, not %lld\n", (long long)v);
          return 2;
        }
        o.splits.push_back(static_cast<int>(v));
      }
    } else if (flag == "--aligned-kernel") {
      o.aligned_kernel = value == "1";
    } else if (flag == "--spread") {
      o.spreads.clear();
      for (absl::string_view s : absl::StrSplit(value, ','))
        o.spreads.push_back(s == "auto" ? -1 : s == "1" ? 1 : 0);
    }
  }
  if (src.empty() || dst.empty() || o.segments.empty() || o.spreads.empty() ||
      o.tile_run_bytes.empty() || o.splits.empty() || o.batch_caps.empty() ||
      o.fill_warps.empty() || o.blocks_per_sm.empty() || o.quantizing.empty() || o.plains.empty() ||
      o.quant_min_blocks.empty()) {
    std::fprintf(
        stderr,
        "usage: local_copy_bench --src T.json --dst I.json [--repeat N] [--segments B,B,...] "
        "[--spread auto,0,1] "
        "[--aligned-kernel 0|1] [--tile-run-bytes B,B,...] [--split 0,1] [--batch-caps N,...] "
        "[--fill-warps N,...] [--blocks-per-sm N,...] [--quantizing auto,0] [--quant-min-blocks "
        "2,3]\n");
    return 2;
  }
  return refit::Run(src, dst, o);
}
