#include "daemon/dataplane/gpu_ids.h"

#include <cstdio>
#include <optional>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace refit {
namespace {

// A PCI address as numbers, so that "0000:3B:00.0", "00000000:3b:00.0" and "3b:00.0" compare equal.
struct PciAddress {
  uint32_t domain = 0, bus = 0, device = 0, function = 0;
  bool operator==(const PciAddress&) const = default;
};

bool ParseHex(absl::string_view s, size_t max_digits, uint32_t* out) {
  if (s.empty() || s.size() > max_digits) return false;
  for (char c : s) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return absl::SimpleHexAtoi(s, out);
}

std::optional<PciAddress> ParsePci(absl::string_view s) {
  std::vector<absl::string_view> parts = absl::StrSplit(s, ':');
  if (parts.size() != 2 && parts.size() != 3) return std::nullopt;
  PciAddress a;
  if (parts.size() == 3 && !ParseHex(parts[0], 8, &a.domain)) return std::nullopt;
  const absl::string_view bus = parts[parts.size() - 2];
  std::vector<absl::string_view> dev_fn = absl::StrSplit(parts.back(), '.');
  if (dev_fn.size() != 2 || !ParseHex(bus, 2, &a.bus) || !ParseHex(dev_fn[0], 2, &a.device) ||
      !ParseHex(dev_fn[1], 1, &a.function)) {
    return std::nullopt;
  }
  return a;
}

// The UUID's hex digits, lowercase, without the "GPU-" prefix and dashes; empty if malformed.
std::string UuidDigits(absl::string_view s) {
  if (absl::StartsWithIgnoreCase(s, "GPU-")) s.remove_prefix(4);
  std::string digits;
  for (char c : s) {
    if (c == '-') continue;
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return "";
    digits.push_back(absl::ascii_tolower(static_cast<unsigned char>(c)));
  }
  return digits.size() == 32 ? digits : "";
}

}  // namespace

std::string FormatGpuUuid(std::span<const unsigned char, 16> b) {
  char out[64];
  std::snprintf(out, sizeof out,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return out;
}

absl::StatusOr<int32_t> FindGpu(std::span<const GpuName> gpus, const std::string& name) {
  const std::string digits = UuidDigits(name);
  const std::optional<PciAddress> pci = digits.empty() ? ParsePci(name) : std::nullopt;
  for (const GpuName& g : gpus) {
    if (!digits.empty() && UuidDigits(g.uuid) == digits) return g.index;
    if (pci.has_value() && ParsePci(g.pci_bus_id) == pci) return g.index;
  }
  std::vector<std::string> served;
  for (const GpuName& g : gpus)
    served.push_back(absl::StrCat(g.index, ": ", g.uuid, " (", g.pci_bus_id, ")"));
  const char* what = !digits.empty() ? "GPU UUID" : pci.has_value() ? "PCI bus id" : "GPU name";
  return absl::InvalidArgumentError(absl::StrCat(
      "no GPU of this daemon has ", what, " \"", name, "\"",
      digits.empty() && !pci.has_value()
          ? " (expected \"GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx\" or \"0000:3b:00.0\")"
          : "",
      "; it serves ", served.empty() ? "none" : absl::StrJoin(served, ", ")));
}

}  // namespace refit
