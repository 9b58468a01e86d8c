// A small declarative option parser: every option is declared once with its default and help, so `--help` always
// lists every option with its default.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace ferry::cli {

struct OptionSpec {
  std::string name;           // without the leading "--"
  std::string default_value;  // "" for none; flags use "false"
  std::string help;
  bool flag = false;  // takes no value (presence sets "true")
};

class Options {
 public:
  Options(std::string command, std::string summary, std::vector<OptionSpec> specs);

  // Parses argv (after the subcommand). Returns false when --help was given (help already printed).
  // Throws ConfigError for an unknown option or a missing value, naming it and pointing to --help.
  bool parse(int argc, char** argv);

  std::string const& str(std::string const& name) const;
  int integer(std::string const& name) const;
  double number(std::string const& name) const;
  bool flag(std::string const& name) const;
  bool given(std::string const& name) const;                 // set on the command line (not just the default)
  std::vector<int> int_list(std::string const& name) const;  // "128,512,4096"
  std::vector<std::string> const& raw_args() const { return raw_; }

  std::string help_text() const;

 private:
  OptionSpec const& spec(std::string const& name) const;
  std::string command_;
  std::string summary_;
  std::vector<OptionSpec> specs_;
  std::map<std::string, std::string> values_;
  std::map<std::string, bool> given_;
  std::vector<std::string> raw_;
};

}  // namespace ferry::cli
