#include "daemon/dataplane/gpu_ids.h"

#include <array>
#include <catch2/catch.hpp>
#include <string>

namespace refit {
namespace {

std::vector<GpuName> Two() {
  return {{0, "GPU-1b2c3d4e-0000-1111-2222-333344445555", "0000:3B:00.0"},
          {1, "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeffff0000", "0000:5D:00.0"}};
}

TEST_CASE("a UUID is formatted as nvidia-smi prints it") {
  std::array<unsigned char, 16> b;
  for (int i = 0; i < 16; ++i) b[i] = static_cast<unsigned char>(i * 17);
  CHECK(FormatGpuUuid(b) == "GPU-00112233-4455-6677-8899-aabbccddeeff");
}

TEST_CASE("GPUs are found by UUID and by PCI bus id, in any case and form") {
  const auto gpus = Two();
  CHECK(*FindGpu(gpus, "GPU-1b2c3d4e-0000-1111-2222-333344445555") == 0);
  CHECK(*FindGpu(gpus, "gpu-AAAAAAAA-BBBB-CCCC-DDDD-EEEEFFFF0000") == 1);
  CHECK(*FindGpu(gpus, "aaaaaaaa-bbbb-cccc-dddd-eeeeffff0000") == 1);
  CHECK(*FindGpu(gpus, "0000:3b:00.0") == 0);
  CHECK(*FindGpu(gpus, "00000000:5D:00.0") == 1);
  CHECK(*FindGpu(gpus, "5d:00.0") == 1);
  CHECK(*FindGpu(gpus, "3B:00.0") == 0);
}

TEST_CASE("an unknown or malformed GPU name lists the GPUs served") {
  const auto gpus = Two();
  for (const char* name : {"GPU-1b2c3d4e-0000-1111-2222-333344445556", "0000:3c:00.0", "banana", "",
                           "3b:00", "GPU-1b2c3d4e"}) {
    auto r = FindGpu(gpus, name);
    REQUIRE_FALSE(r.ok());
    INFO(r.status().message());
    CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(r.status().message()).find("GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeffff0000") !=
          std::string::npos);
    CHECK(std::string(r.status().message()).find("0000:3B:00.0") != std::string::npos);
  }
  CHECK(std::string(FindGpu({}, "GPU-1b2c3d4e-0000-1111-2222-333344445555").status().message())
            .find("serves none") != std::string::npos);
}

}  // namespace
}  // namespace refit
