// Pack/unpack kernel bandwidth on one GPU, against the copy engine in the same run.
// A message of tensor-parallel column slices (strided runs), one of whole rows (contiguous),
// bf16 -> bf16 and bf16 -> fp32, and one of 32,768 small tensors; medians of --repeat runs after
// warm-up; one JSON line per case.
//   copy_bench [--repeat 20]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/copy_kernels.h"
#include "kernels/cuda_check.h"
#include "plan/planner.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"

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

// 16 weights [4096, 4096] bf16 on one rank; the destination takes 1/8 of each (TP8): columns
// (4096 runs of 1 KiB per tensor) or rows (contiguous).
void TensorParallelLayouts(int split_dim, DType dst_dtype, Layout& src, Layout& dst) {
  for (int t = 0; t < 16; ++t) {
    const std::string tn = absl::StrCat("w", t);
    testing::AddSplitTensor(src, tn, Dims{4096, 4096}, DType::kBF16, 0, {0, 4096}, {{0, 0}},
                            "trainer");
    testing::AddSplitTensor(dst, tn, Dims{4096, 4096}, dst_dtype, split_dim, {0, 512}, {{1, 0}},
                            "engine");
  }
}

// 32,768 whole tensors of 2, 4 and 8 KiB, each in a buffer of its own: a fine-grained MoE's
// expert biases and norms, where the cost per copy item, not per byte, decides.
void ManySmallLayouts(Layout& src, Layout& dst) {
  for (int t = 0; t < 32768; ++t) {
    const std::string tn = absl::StrCat("e", t);
    const int64_t n = int64_t{1024} << (t % 3);
    testing::AddSplitTensor(src, tn, Dims{n}, DType::kBF16, 0, {0, n}, {{0, 0}}, "trainer");
    testing::AddSplitTensor(dst, tn, Dims{n}, DType::kBF16, 0, {0, n}, {{1, 0}}, "engine");
  }
}

void Case(const std::string& name, Layout src, Layout dst, int repeat, cudaStream_t stream) {
  ValidateLayout(src, "source").IgnoreError();
  ValidateLayout(dst, "destination").IgnoreError();
  PlanOptions options;
  options.max_message_bytes = int64_t{1} << 30;
  Plan plan = *MakePlan(src, dst, options);
  const Message& m = plan.messages[0];
  std::vector<std::unique_ptr<DeviceBuffer>> sb, db;
  BufferAddresses sa, da;
  for (const Buffer& b : src.buffers)
    sb.push_back(std::make_unique<DeviceBuffer>(b.NumBytes())), sa.push_back(sb.back()->address());
  for (const Buffer& b : dst.buffers)
    db.push_back(std::make_unique<DeviceBuffer>(b.NumBytes())), da.push_back(db.back()->address());
  DeviceBuffer staging(m.bytes), copy_dst(m.bytes);
  auto upload = [](const CopyWork& w) {
    auto items = std::make_unique<DeviceBuffer>(w.items.size() * sizeof(CopyItem));
    auto begin = std::make_unique<DeviceBuffer>(w.unit_begin.size() * sizeof(int64_t));
    REFIT_CUDA_CHECK(
        cudaMemcpy(items->get(), w.items.data(), items->size(), cudaMemcpyHostToDevice));
    REFIT_CUDA_CHECK(
        cudaMemcpy(begin->get(), w.unit_begin.data(), begin->size(), cudaMemcpyHostToDevice));
    return std::make_pair(std::move(items), std::move(begin));
  };
  const CopyWork pack = PackWork(plan, m, sa, da, staging.address());
  const CopyWork unpack = UnpackWork(plan, m, staging.address(), da);
  auto [pi, pb] = upload(pack);
  auto [ui, ub] = upload(unpack);
  std::vector<float> tp, tu, tc;
  for (int r = 0; r < repeat + 3; ++r) {
    const float p = TimeMs(stream, [&] {
      REFIT_CUDA_CHECK(
          LaunchCopyItems(static_cast<CopyItem*>(pi->get()), static_cast<int64_t*>(pb->get()),
                          static_cast<int>(pack.items.size()), pack.unit_begin.back(), stream));
    });
    const float u = TimeMs(stream, [&] {
      REFIT_CUDA_CHECK(
          LaunchCopyItems(static_cast<CopyItem*>(ui->get()), static_cast<int64_t*>(ub->get()),
                          static_cast<int>(unpack.items.size()), unpack.unit_begin.back(), stream));
    });
    const float c = TimeMs(stream, [&] {
      REFIT_CUDA_CHECK(cudaMemcpyAsync(copy_dst.get(), staging.get(), m.bytes,
                                       cudaMemcpyDeviceToDevice, stream));
    });
    if (r >= 3) tp.push_back(p), tu.push_back(u), tc.push_back(c);  // 3 warm-up runs
  }
  const double gb = m.bytes / 1e9;
  std::printf(
      "{\"case\":\"%s\",\"messages\":%zu,\"message_bytes\":%lld,\"descriptors\":%lld,\"runs\":%d,"
      "\"pack_ms\":%.4f,\"unpack_ms\":%.4f,\"memcpy_d2d_ms\":%.4f,"
      "\"pack_gbps\":%.1f,\"unpack_gbps\":%.1f,\"memcpy_d2d_gbps\":%.1f,"
      "\"pack_vs_memcpy\":%.3f,\"unpack_vs_memcpy\":%.3f}\n",
      name.c_str(), plan.messages.size(), (long long)m.bytes, (long long)m.num_descriptors, repeat,
      Median(tp), Median(tu), Median(tc), gb / (Median(tp) / 1e3), gb / (Median(tu) / 1e3),
      gb / (Median(tc) / 1e3), Median(tc) / Median(tp), Median(tc) / Median(tu));
  std::fflush(stdout);
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  using namespace refit;
  int repeat = 20;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--repeat") repeat = std::max(1, std::atoi(argv[i + 1]));
  }
  if (GpuCount() == 0) {
    std::fprintf(stderr, "copy_bench: no GPU\n");
    return 1;
  }
  cudaStream_t stream;
  REFIT_CUDA_CHECK(cudaStreamCreate(&stream));
  for (auto [name, split_dim, dtype] : {std::tuple{"tp8_columns_bf16", 1, DType::kBF16},
                                        std::tuple{"tp8_rows_bf16", 0, DType::kBF16},
                                        std::tuple{"tp8_columns_bf16_to_fp32", 1, DType::kF32}}) {
    Layout src, dst;
    TensorParallelLayouts(split_dim, dtype, src, dst);
    Case(name, std::move(src), std::move(dst), repeat, stream);
  }
  Layout src, dst;
  ManySmallLayouts(src, dst);
  Case("many_small_2k_to_8k", std::move(src), std::move(dst), repeat, stream);
  return 0;
}
