// Command lines of refit's programs: --name=value, --name value, boolean --name and --noname,
// short aliases (-o), --help. One splitter serves both ways of holding the values:
//
// - FlagSet: a program's absl flags (ABSL_FLAG), set from the command line and from config files
//   with errors returned as a status, so that only main decides to exit. absl's own
//   ParseCommandLine is not used: it knows no dashes in names (refitd's --worker-socket), and on
//   bad input or --help it ends the process itself (code 1, several lines), where refit's
//   programs answer bad input with one line naming the flag and code 2.
// - CliFlags: flags bound to local variables, for the small tools and benchmarks; it prints the
//   error and exits 2 itself.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace refit {

// A flag as the command line gave it: its name (without "--", as --help lists it) and its value
// ("true" or "false" for a bare boolean --name or --noname).
struct GivenFlag {
  std::string name, value;
};

// argv split, in order, up to --help when that is given.
struct CommandLine {
  std::vector<GivenFlag> flags;
  std::vector<std::string> positional;
  bool help = false;

  // Whether the command line named flag `name` (a short alias counts as its flag).
  bool Given(absl::string_view name) const;
};

// What a splitter must know of a flag named on the command line.
struct KnownFlag {
  std::string name;  // as --help lists it: a short alias maps to its flag's name
  bool is_bool = false;
};
using FindFlagFn = std::function<std::optional<KnownFlag>(absl::string_view name)>;

// Splits argv[1..] into flags and positional arguments; stops at -h or --help. An unknown flag or
// a flag without its value is an error naming it.
absl::StatusOr<CommandLine> SplitCommandLine(int argc, const char* const* argv,
                                             const FindFlagFn& find);

// An error as one line for stderr: "program: message", newlines made spaces.
std::string ErrorLine(absl::string_view program, absl::string_view message);

// A flag's name on the command line: "worker-socket" for FLAGS_worker_socket.
std::string CommandLineName(const absl::CommandLineFlag& flag);
template <typename T>
std::string CommandLineName(const absl::Flag<T>& flag) {
  return CommandLineName(absl::GetFlagReflectionHandle(flag));
}

// A program's absl flags. On the command line and in --help a flag's name has dashes where its
// ABSL_FLAG name has underscores (FLAGS_worker_socket is --worker-socket). absl flags are
// process-wide: parse with one FlagSet at a time.
class FlagSet {
 public:
  // The flags in the order --help lists them, e.g. FlagSet("refitd", "[flags]", FLAGS_node, ...).
  template <typename... T>
  FlagSet(std::string program, std::string usage, const absl::Flag<T>&... flags)
      : FlagSet(
            std::move(program), std::move(usage),
            std::vector<const absl::CommandLineFlag*>{&absl::GetFlagReflectionHandle(flags)...}) {}
  FlagSet(std::string program, std::string usage,
          const std::vector<const absl::CommandLineFlag*>& flags);

  // -`short_name` stands for --`name`.
  void Alias(std::string short_name, std::string name);

  absl::StatusOr<CommandLine> Split(int argc, const char* const* argv) const;
  // Every flag back to its default, so that a parse depends on its own arguments alone.
  absl::Status ResetToDefaults() const;
  // Sets the flags in order; a value the flag's type refuses is an error naming the flag.
  absl::Status Apply(const std::vector<GivenFlag>& flags) const;
  // Whether `name` (without "--", with dashes) is one of the flags.
  bool Has(absl::string_view name) const;
  // The usage line and every flag with its help text and default.
  std::string Help() const;
  const std::string& program() const { return program_; }

 private:
  struct Entry {
    std::string name, alias;
    absl::CommandLineFlag* flag;
  };
  const Entry* Find(absl::string_view name) const;

  std::string program_, usage_;
  std::vector<Entry> entries_;
};

// Flags bound to local variables. Errors are one line on stderr and exit code 2, as our tools
// promise for every kind of bad input.
class CliFlags {
 public:
  CliFlags(std::string program, std::string usage);

  void String(const std::string& name, std::string* value, const std::string& help,
              const std::string& alias = "");
  void Int(const std::string& name, int64_t* value, const std::string& help);
  void Double(const std::string& name, double* value, const std::string& help);
  void Bool(const std::string& name, bool* value, const std::string& help);

  // Parses argv; on --help prints usage and exits 0; on an error prints one line and exits 2.
  // Returns the positional arguments.
  std::vector<std::string> Parse(int argc, char** argv);

  [[noreturn]] void Fail(const std::string& message) const;
  // Errors from now on begin with `context` (e.g. the config file the values came from); "" ends
  // it.
  void SetErrorContext(std::string context) { context_ = std::move(context); }
  // Whether `name` (without "--") is one of the flags.
  bool Has(const std::string& name) const { return Find(name) != nullptr; }

 private:
  struct Flag {
    std::string name, alias, help, default_text;
    bool is_bool = false;
    std::function<bool(const std::string&)> set;
  };
  const Flag* Find(absl::string_view name) const;
  std::string program_, usage_, context_;
  std::vector<Flag> flags_;
};

}  // namespace refit
