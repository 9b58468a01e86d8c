#include "options.hpp"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "ferry/error.hpp"

namespace ferry::cli {

Options::Options(std::string command, std::string summary, std::vector<OptionSpec> specs)
    : command_(std::move(command)), summary_(std::move(summary)), specs_(std::move(specs)) {
  for (auto const& spec : specs_) values_[spec.name] = spec.flag ? "false" : spec.default_value;
}

OptionSpec const& Options::spec(std::string const& name) const {
  for (auto const& spec : specs_)
    if (spec.name == name) return spec;
  FERRY_THROW(ConfigError, "config", "ferry ", command_, ": unknown option --", name, "; see ferry ", command_,
              " --help");
}

bool Options::parse(int argc, char** argv) {
  for (int i = 0; i < argc; ++i) {
    raw_.emplace_back(argv[i]);
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(help_text().c_str(), stdout);
      return false;
    }
    FERRY_CHECK_CONFIG(arg.rfind("--", 0) == 0, "ferry ", command_, ": unexpected argument '", arg,
                       "'; options start with --, see ferry ", command_, " --help");
    arg = arg.substr(2);
    std::string value;
    bool has_value = false;
    if (auto const eq = arg.find('='); eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    OptionSpec const& option = spec(arg);
    if (option.flag) {
      values_[arg] = has_value ? value : "true";
    } else {
      if (!has_value) {
        FERRY_CHECK_CONFIG(i + 1 < argc, "ferry ", command_, ": option --", arg, " needs a value");
        value = argv[++i];
        raw_.emplace_back(value);
      }
      values_[arg] = value;
    }
    given_[arg] = true;
  }
  return true;
}

std::string const& Options::str(std::string const& name) const {
  spec(name);
  return values_.at(name);
}

int Options::integer(std::string const& name) const {
  std::string const& text = str(name);
  errno = 0;
  char* end = nullptr;
  long const value = std::strtol(text.c_str(), &end, 10);
  FERRY_CHECK_CONFIG(!text.empty() && errno == 0 && *end == '\0', "--", name, "=", text, " is not an integer");
  return static_cast<int>(value);
}

double Options::number(std::string const& name) const {
  std::string const& text = str(name);
  errno = 0;
  char* end = nullptr;
  double const value = std::strtod(text.c_str(), &end);
  FERRY_CHECK_CONFIG(!text.empty() && errno == 0 && *end == '\0', "--", name, "=", text, " is not a number");
  return value;
}

bool Options::flag(std::string const& name) const {
  std::string const& text = str(name);
  return text == "true" || text == "1" || text == "yes";
}

bool Options::given(std::string const& name) const {
  spec(name);
  return given_.count(name) > 0;
}

std::vector<int> Options::int_list(std::string const& name) const {
  std::vector<int> out;
  std::stringstream stream(str(name));
  std::string item;
  while (std::getline(stream, item, ',')) {
    errno = 0;
    char* end = nullptr;
    long const value = std::strtol(item.c_str(), &end, 10);
    FERRY_CHECK_CONFIG(!item.empty() && errno == 0 && *end == '\0', "--", name, "=", str(name),
                       " is not a comma-separated list of integers");
    out.push_back(static_cast<int>(value));
  }
  FERRY_CHECK_CONFIG(!out.empty(), "--", name, " is empty");
  return out;
}

std::string Options::help_text() const {
  std::ostringstream out;
  out << "usage: ferry " << command_ << " [options]\n" << summary_ << "\n\noptions (default in brackets):\n";
  for (auto const& spec : specs_) {
    std::string left = "  --" + spec.name + (spec.flag ? "" : " V");
    out << left;
    out << std::string(left.size() < 26 ? 26 - left.size() : 1, ' ') << spec.help;
    if (!spec.flag) out << " [" << (spec.default_value.empty() ? "unset" : spec.default_value) << "]";
    out << "\n";
  }
  out << "  --help                  this text\n";
  return out.str();
}

}  // namespace ferry::cli
