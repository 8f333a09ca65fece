// A small command-line parser for refit's tools: --name=value, --name value, boolean --name,
// short aliases (-o), --help. Errors are one line on stderr and exit code 2, as our tools promise
// for every kind of bad input.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace refit {

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
  const Flag* Find(const std::string& name) const;
  std::string program_, usage_, context_;
  std::vector<Flag> flags_;
};

}  // namespace refit
