#include "common/cli_flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace refit {
namespace {

bool IsHelp(absl::string_view arg) { return arg == "-h" || arg == "--help"; }

// A flag's value: after "=" in the same argument, else the next argument; a bare boolean is
// "true". Advances `i` past a value taken from the next argument.
absl::StatusOr<std::string> FlagValue(const KnownFlag& flag,
                                      std::optional<std::string> inline_value, int argc,
                                      const char* const* argv, int& i) {
  if (inline_value.has_value()) return *std::move(inline_value);
  if (flag.is_bool) return std::string("true");
  if (i + 1 >= argc) {
    return absl::InvalidArgumentError(absl::StrCat("flag --", flag.name, " needs a value"));
  }
  return std::string(argv[++i]);
}

// One line of --help: the flag, its alias, its help text and its default.
std::string HelpEntry(absl::string_view name, absl::string_view alias, absl::string_view help,
                      absl::string_view default_text) {
  return absl::StrCat("  --", name, alias.empty() ? "" : ", -", alias, "\n      ", help,
                      " (default: ", default_text.empty() ? "\"\"" : default_text, ")\n");
}

std::string CannotUse(absl::string_view name, absl::string_view value) {
  return absl::StrCat("flag --", name, ": cannot use \"", value, "\"");
}

}  // namespace

bool CommandLine::Given(absl::string_view name) const {
  return std::any_of(flags.begin(), flags.end(),
                     [name](const GivenFlag& f) { return f.name == name; });
}

absl::StatusOr<CommandLine> SplitCommandLine(int argc, const char* const* argv,
                                             const FindFlagFn& find) {
  CommandLine out;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (IsHelp(arg)) {
      out.help = true;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      out.positional.push_back(arg);
      continue;
    }
    std::string name = arg.substr(arg[1] == '-' ? 2 : 1);
    std::optional<std::string> inline_value;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name.resize(eq);
    }
    std::optional<KnownFlag> flag = find(name);
    if (!flag.has_value() && !inline_value.has_value() && absl::StartsWith(name, "no")) {
      if (std::optional<KnownFlag> negated = find(name.substr(2)); negated && negated->is_bool) {
        out.flags.push_back({negated->name, "false"});
        continue;
      }
    }
    if (!flag.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag \"", arg, "\" (see --help)"));
    }
    absl::StatusOr<std::string> value = FlagValue(*flag, std::move(inline_value), argc, argv, i);
    if (!value.ok()) return value.status();
    out.flags.push_back({flag->name, *std::move(value)});
  }
  return out;
}

std::string ErrorLine(absl::string_view program, absl::string_view message) {
  return absl::StrCat(program, ": ", absl::StrReplaceAll(message, {{"\n", " "}}));
}

std::string CommandLineName(const absl::CommandLineFlag& flag) {
  return absl::StrReplaceAll(flag.Name(), {{"_", "-"}});
}

// FlagSet

FlagSet::FlagSet(std::string program, std::string usage,
                 const std::vector<const absl::CommandLineFlag*>& flags)
    : program_(std::move(program)), usage_(std::move(usage)) {
  for (const absl::CommandLineFlag* handle : flags) {
    // The registry hands out the flag it can set; the handle of an absl::Flag is read-only.
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(handle->Name());
    entries_.push_back({CommandLineName(*flag), "", flag});
  }
}

void FlagSet::Alias(std::string short_name, std::string name) {
  for (Entry& e : entries_) {
    if (e.name == name) e.alias = std::move(short_name);
  }
}

const FlagSet::Entry* FlagSet::Find(absl::string_view name) const {
  for (const Entry& e : entries_) {
    if (e.name == name || (!e.alias.empty() && e.alias == name)) return &e;
  }
  return nullptr;
}

bool FlagSet::Has(absl::string_view name) const { return Find(name) != nullptr; }

absl::StatusOr<CommandLine> FlagSet::Split(int argc, const char* const* argv) const {
  return SplitCommandLine(argc, argv, [this](absl::string_view name) -> std::optional<KnownFlag> {
    const Entry* e = Find(name);
    if (e == nullptr) return std::nullopt;
    return KnownFlag{e->name, e->flag->IsOfType<bool>()};
  });
}

absl::Status FlagSet::ResetToDefaults() const {
  for (const Entry& e : entries_) {
    std::string error;
    if (!e.flag->ParseFrom(e.flag->DefaultValue(), &error)) {
      return absl::InternalError(absl::StrCat("flag --", e.name, ": default: ", error));
    }
  }
  return absl::OkStatus();
}

absl::Status FlagSet::Apply(const std::vector<GivenFlag>& flags) const {
  for (const GivenFlag& given : flags) {
    const Entry* e = Find(given.name);
    if (e == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag \"--", given.name, "\""));
    }
    std::string error;
    if (!e->flag->ParseFrom(given.value, &error)) {
      return absl::InvalidArgumentError(CannotUse(e->name, given.value));
    }
  }
  return absl::OkStatus();
}

std::string FlagSet::Help() const {
  std::string out = absl::StrCat("usage: ", program_, " ", usage_, "\n\nflags:\n");
  for (const Entry& e : entries_) {
    absl::StrAppend(&out, HelpEntry(e.name, e.alias, e.flag->Help(), e.flag->DefaultValue()));
  }
  return out;
}

// CliFlags

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

const CliFlags::Flag* CliFlags::Find(absl::string_view name) const {
  for (const Flag& f : flags_) {
    if (f.name == name || (!f.alias.empty() && f.alias == name)) return &f;
  }
  return nullptr;
}

void CliFlags::Fail(const std::string& message) const {
  const std::string line =
      ErrorLine(program_, context_.empty() ? message : context_ + ": " + message);
  std::fprintf(stderr, "%s\n", line.c_str());
  std::exit(2);
}

std::vector<std::string> CliFlags::Parse(int argc, char** argv) {
  absl::StatusOr<CommandLine> line =
      SplitCommandLine(argc, argv, [this](absl::string_view name) -> std::optional<KnownFlag> {
        const Flag* f = Find(name);
        if (f == nullptr) return std::nullopt;
        return KnownFlag{f->name, f->is_bool};
      });
  if (!line.ok()) Fail(std::string(line.status().message()));
  for (const GivenFlag& given : line->flags) {
    if (!Find(given.name)->set(given.value)) Fail(CannotUse(given.name, given.value));
  }
  if (line->help) {
    std::printf("usage: %s %s\n\nflags:\n", program_.c_str(), usage_.c_str());
    for (const Flag& f : flags_) {
      std::fputs(HelpEntry(f.name, f.alias, f.help, f.default_text).c_str(), stdout);
    }
    std::exit(0);
  }
  return line->positional;
}

}  // namespace refit
