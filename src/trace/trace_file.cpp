#include "trace/trace_file.hpp"

#include <algorithm>
#include <bit>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "ferry/error.hpp"
#include "trace/decode.hpp"
#include "core/util/json.hpp"

namespace ferry::trace {
namespace {

namespace fs = std::filesystem;
namespace json = util::json;

// NOTE: the files are the in-memory arrays; a big-endian host would need byte swaps, which no CUDA host needs.
static_assert(std::endian::native == std::endian::little, "trace files are little-endian");

constexpr int kVersion = 1;

std::string base_name(std::string const& label, TraceBuffer const& buffer) {
  return label + ".rank" + std::to_string(buffer.rank) + "." + trace_kernel_name(buffer.kernel);
}

int64_t member_int(json::Value const& doc, char const* key, std::string const& source) {
  json::Value const* v = doc.find(key);
  FERRY_CHECK_AS(ConfigError, "trace", v && v->is_integer(), source, ": \"", key, "\" is missing or not an integer");
  return v->integer();
}

std::string member_text(json::Value const& doc, char const* key, std::string const& source) {
  json::Value const* v = doc.find(key);
  FERRY_CHECK_AS(ConfigError, "trace", v && v->is(json::Value::Kind::string), source, ": \"", key,
                 "\" is missing or not a string");
  return v->text;
}

}  // namespace

void write_trace_files(std::string const& dir, std::string const& label, TraceBuffer const& buffer) {
  FERRY_CHECK_CONFIG(!label.empty() && std::all_of(label.begin(), label.end(),
                                                   [](char c) {
                                                     return std::isalnum(static_cast<unsigned char>(c)) || c == '-' ||
                                                            c == '_' || c == '.';
                                                   }),
                     "trace label '", label, "' may hold only letters, digits, '-', '_' and '.'");
  std::error_code error;
  fs::create_directories(dir, error);
  FERRY_CHECK_CONFIG(!error, "trace folder ", dir, " cannot be created: ", error.message());
  std::string const base = base_name(label, buffer);
  {
    std::ofstream data(fs::path(dir) / (base + ".bin"), std::ios::binary);
    data.write(reinterpret_cast<char const*>(buffer.counts.data()),
               static_cast<std::streamsize>(buffer.counts.size() * sizeof(uint32_t)));
    data.write(reinterpret_cast<char const*>(buffer.events.data()),
               static_cast<std::streamsize>(buffer.events.size() * sizeof(TraceEvent)));
    FERRY_CHECK_CONFIG(data.good(), "trace file ", (fs::path(dir) / (base + ".bin")).string(), " cannot be written");
  }
  std::ofstream header(fs::path(dir) / (base + ".json"));
  header << "{\"format\": \"ferry-trace\", \"version\": " << kVersion << ", \"label\": " << json::quote(label)
         << ", \"rank\": " << buffer.rank << ", \"kernel\": \"" << trace_kernel_name(buffer.kernel)
         << "\", \"ctas\": " << buffer.ctas << ", \"warps_per_cta\": " << buffer.warps_per_cta
         << ", \"capacity\": " << buffer.capacity << ", \"data\": " << json::quote(base + ".bin") << ", \"slots\": [";
  std::vector<std::string> const names = slot_names();
  for (std::size_t i = 0; i < names.size(); ++i) header << (i ? ", " : "") << json::quote(names[i]);
  header << "]}\n";
  FERRY_CHECK_CONFIG(header.good(), "trace file ", (fs::path(dir) / (base + ".json")).string(), " cannot be written");
}

std::map<std::string, std::vector<TraceBuffer>> read_trace_dir(std::string const& dir) {
  std::error_code error;
  FERRY_CHECK_CONFIG(fs::is_directory(dir, error), "trace folder ", dir,
                     " does not exist; write one with ferry bench --trace ", dir);
  std::vector<fs::path> headers;
  for (fs::directory_entry const& entry : fs::directory_iterator(dir))
    if (entry.is_regular_file() && entry.path().extension() == ".json") headers.push_back(entry.path());
  std::sort(headers.begin(), headers.end());
  std::vector<std::string> const names = slot_names();
  std::map<std::string, std::vector<TraceBuffer>> out;
  for (fs::path const& path : headers) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    std::string const source = path.string();
    json::Value const doc = json::parse(text.str(), source);
    json::Value const* format = doc.find("format");
    if (!format || !format->is(json::Value::Kind::string) || format->text != "ferry-trace") continue;  // other JSON
    FERRY_CHECK_AS(ConfigError, "trace", member_int(doc, "version", source) == kVersion, source, ": version ",
                   member_int(doc, "version", source), " is not ", kVersion,
                   "; decode it with the ferry that wrote it");
    json::Value const* slots = doc.find("slots");
    FERRY_CHECK_AS(ConfigError, "trace", slots && slots->is(json::Value::Kind::array), source, ": \"slots\" missing");
    bool same = slots->items.size() == names.size();
    for (std::size_t i = 0; same && i < names.size(); ++i)
      same = slots->items[i].is(json::Value::Kind::string) && slots->items[i].text == names[i];
    FERRY_CHECK_AS(ConfigError, "trace", same, source,
                   ": written with another slot table (src/trace/trace_slots.hpp) than this build's; decode it with "
                   "the ferry that wrote it");
    TraceBuffer buffer;
    buffer.rank = static_cast<int>(member_int(doc, "rank", source));
    buffer.kernel = parse_trace_kernel(member_text(doc, "kernel", source));
    buffer.ctas = static_cast<int>(member_int(doc, "ctas", source));
    buffer.warps_per_cta = static_cast<int>(member_int(doc, "warps_per_cta", source));
    buffer.capacity = static_cast<int>(member_int(doc, "capacity", source));
    FERRY_CHECK_AS(ConfigError, "trace",
                   buffer.rank >= 0 && buffer.ctas >= 0 && buffer.warps_per_cta >= 0 && buffer.capacity >= 0 &&
                       buffer.ctas <= (1 << 16) && buffer.warps_per_cta <= 64 && buffer.capacity <= (1 << 24),
                   source, ": geometry out of range (rank ", buffer.rank, ", ctas ", buffer.ctas, ", warps_per_cta ",
                   buffer.warps_per_cta, ", capacity ", buffer.capacity, ")");
    fs::path const data_path = path.parent_path() / member_text(doc, "data", source);
    std::size_t const warps = static_cast<std::size_t>(buffer.num_warps());
    std::size_t const bytes = warps * sizeof(uint32_t) + warps * buffer.capacity * sizeof(TraceEvent);
    std::error_code size_error;
    auto const size = fs::file_size(data_path, size_error);
    FERRY_CHECK_AS(ConfigError, "trace", !size_error && size == bytes, data_path.string(), " holds ",
                   size_error ? std::string("nothing readable") : std::to_string(size) + " bytes", "; its header ",
                   source, " needs ", bytes);
    buffer.counts.resize(warps);
    buffer.events.resize(warps * buffer.capacity);
    std::ifstream data(data_path, std::ios::binary);
    data.read(reinterpret_cast<char*>(buffer.counts.data()), static_cast<std::streamsize>(warps * sizeof(uint32_t)));
    data.read(reinterpret_cast<char*>(buffer.events.data()),
              static_cast<std::streamsize>(buffer.events.size() * sizeof(TraceEvent)));
    FERRY_CHECK_AS(ConfigError, "trace", data.good(), data_path.string(), " cannot be read");
    out[member_text(doc, "label", source)].push_back(std::move(buffer));
  }
  for (auto& [label, buffers] : out)
    std::sort(buffers.begin(), buffers.end(), [](TraceBuffer const& a, TraceBuffer const& b) {
      return a.rank != b.rank ? a.rank < b.rank : a.kernel < b.kernel;
    });
  return out;
}

}  // namespace ferry::trace
