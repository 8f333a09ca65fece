#include "common/cli_flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace refit {

CliFlags::CliFlags(std::string program, std::string usage)
    : program_(std::move(program)), usage_(std::move(usage)) {}

void CliFlags::String(const std::string& name, std::string* value, const std::string& help,
                      const std::string& alias) {
  flags_.push_back({name, alias, help, *value, false, [value](const std::string& v) {
                      *value = v;
                      return true;
                    }});
}

void CliFlags::Int(const std::string& name, int64_t* value, const std::string& help) {
  flags_.push_back({name, "", help, absl::StrCat(*value), false,
                    [value](const std::string& v) { return absl::SimpleAtoi(v, value); }});
}

void CliFlags::Double(const std::string& name, double* value, const std::string& help) {
  flags_.push_back({name, "", help, absl::StrCat(*value), false,
                    [value](const std::string& v) { return absl::SimpleAtod(v, value); }});
}

void CliFlags::Bool(const std::string& name, bool* value, const std::string& help) {
  flags_.push_back({name, "", help, *value ? "true" : "false", true, [value](const std::string& v) {
                      if (v == "true" || v == "1" || v.empty()) return *value = true, true;
                      if (v == "false" || v == "0") return *value = false, true;
                      return false;
                    }});
}

const CliFlags::Flag* CliFlags::Find(const std::string& name) const {
  for (const Flag& f : flags_) {
    if (f.name == name || (!f.alias.empty() && f.alias == name)) return &f;
  }
  return nullptr;
}

void CliFlags::Fail(const std::string& message) const {
  std::string line = context_.empty() ? message : context_ + ": " + message;
  std::replace(line.begin(), line.end(), '\n', ' ');
  std::fprintf(stderr, "%s: %s\n", program_.c_str(), line.c_str());
  std::exit(2);
}

std::vector<std::string> CliFlags::Parse(int argc, char** argv) {
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::printf("usage: %s %s\n\nflags:\n", program_.c_str(), usage_.c_str());
      for (const Flag& f : flags_) {
        std::printf("  --%s%s%s\n      %s (default: %s)\n", f.name.c_str(),
                    f.alias.empty() ? "" : ", -", f.alias.c_str(), f.help.c_str(),
                    f.default_text.empty() ? "\"\"" : f.default_text.c_str());
      }
      std::exit(0);
    }
    if (arg.size() < 2 || arg[0] != '-') {
      positional.push_back(arg);
      continue;
    }
    std::string name = arg.substr(arg[1] == '-' ? 2 : 1), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    const Flag* flag = Find(name);
    if (flag == nullptr && name.rfind("no", 0) == 0 && !has_value) {
      const Flag* negated = Find(name.substr(2));
      if (negated != nullptr && negated->is_bool) {
        negated->set("false");
        continue;
      }
    }
    if (flag == nullptr) Fail(absl::StrCat("unknown flag \"", arg, "\" (see --help)"));
    if (!has_value && !flag->is_bool) {
      if (i + 1 >= argc) Fail(absl::StrCat("flag --", flag->name, " needs a value"));
      value = argv[++i];
    }
    if (!flag->set(value)) {
      Fail(absl::StrCat("flag --", flag->name, ": cannot use \"", value, "\""));
    }
  }
  return positional;
}

}  // namespace refit
