// The failure of a GPU test run where no GPU is present. GPU tests are tagged "gpu": CI leaves
// them out (tools/test.sh) and tools/gpu_test.sh runs them on a GPU machine. Run anywhere else
// they fail, so that a test that did not run is never counted as passed.
#pragma once

namespace refit {

inline constexpr char kNeedsGpu[] =
    "this test needs a GPU and none is present; GPU tests are tagged \"gpu\" and run on a GPU "
    "machine by tools/gpu_test.sh";

}  // namespace refit
