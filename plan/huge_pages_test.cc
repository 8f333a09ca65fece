// AdviseHugePages is advice: whatever the kernel does with it, memory keeps its contents and
// stays writable, for ranges of any alignment and size (the planner advises its arrays with
// whatever bounds the allocator gave them).
#include "plan/huge_pages.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <memory>
#include <vector>

namespace refit {
namespace {

TEST_CASE("advised memory keeps its contents and stays writable") {
  constexpr size_t kBytes = size_t{9} << 20;  // spans several whole 2 MiB pages
  std::unique_ptr<uint8_t[]> data(new uint8_t[kBytes]);
  for (size_t i = 0; i < kBytes; ++i) data[i] = static_cast<uint8_t>(i * 131 + 7);
  AdviseHugePages(data.get(), kBytes);
  AdviseHugePages(data.get() + 3, 4096);  // no whole huge page inside: nothing to advise
  AdviseHugePages(data.get() + 1, kBytes - 1);
  AdviseHugePages(data.get(), 0);
  for (size_t i = 0; i < kBytes; ++i) {
    if (data[i] != static_cast<uint8_t>(i * 131 + 7)) FAIL("byte " << i << " changed");
    data[i] = static_cast<uint8_t>(~data[i]);
  }
  CHECK(data[kBytes - 1] == static_cast<uint8_t>(~static_cast<uint8_t>((kBytes - 1) * 131 + 7)));
}

TEST_CASE("memory advised before its first touch reads as zeros when zeroed, then holds writes") {
  std::vector<int64_t> v;
  v.reserve(size_t{1} << 20);  // 8 MiB, untouched
  AdviseHugePages(v.data(), v.capacity() * sizeof(int64_t));
  v.resize(v.capacity());
  for (int64_t x : v) REQUIRE(x == 0);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int64_t>(i);
  for (size_t i = 0; i < v.size(); ++i) REQUIRE(v[i] == static_cast<int64_t>(i));
}

}  // namespace
}  // namespace refit
