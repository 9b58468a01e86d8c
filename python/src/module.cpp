// The module definition: what Python sees of the C++ API, the binding's classes and their docstrings. Each bind_*
// step registers one part; NB_MODULE calls them in order (errors first: later signatures name their types).

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "binding.hpp"
#include "core/launcher.hpp"
#include "ep/tuning_key.hpp"
#include "ferry/env.hpp"
#include "ferry/interrupt.hpp"
#include "tuning/choose.hpp"
#include "tuning/table.hpp"

namespace ferry::python {
namespace {

using detail::concat;
using namespace nb::literals;

// A geometry pin is its CTA count in Python (0: choose).
std::optional<Geometry> geometry_from(std::optional<int> const& blocks) {
  if (!blocks) return std::nullopt;
  return Geometry{*blocks};
}

std::optional<int> geometry_to(std::optional<Geometry> const& value) {
  if (!value) return std::nullopt;
  return value->blocks;
}

EpConfig make_config(int hidden, int num_experts, int topk, int max_tokens_per_rank, std::optional<int> expert_capacity,
                     std::optional<int> max_recv_tokens, std::string const& dispatch_format,
                     std::string const& combine_format, bool dispatch_dequantize, std::string const& recv_scale_layout,
                     std::string const& mode, std::optional<int> dispatch_geometry, std::optional<int> combine_geometry,
                     std::string const& internode_route, bool rank_masking, bool wait_stats) {
  EpConfig config;
  config.hidden = hidden;
  config.num_experts = num_experts;
  config.topk = topk;
  config.max_tokens_per_rank = max_tokens_per_rank;
  config.expert_capacity = expert_capacity;
  config.max_recv_tokens = max_recv_tokens;
  config.dispatch_format = parse_wire_format(dispatch_format);
  config.combine_format = parse_wire_format(combine_format);
  config.dispatch_dequantize = dispatch_dequantize;
  config.recv_scale_layout = parse_scale_layout(recv_scale_layout);
  config.mode = parse_mode(mode);
  config.dispatch_geometry = geometry_from(dispatch_geometry);
  config.combine_geometry = geometry_from(combine_geometry);
  config.internode_route = parse_internode_route(internode_route);
  config.rank_masking = rank_masking;
  config.wait_stats = wait_stats;
  return config;
}

[[noreturn]] void raise_for_test(std::string const& kind, std::string const& message) {
  if (kind == "Error") FERRY_THROW(Error, "test", message);
  if (kind == "ConfigError") FERRY_THROW(ConfigError, "test", message);
  if (kind == "InputError") FERRY_THROW(InputError, "test", message);
  if (kind == "CudaError") FERRY_THROW(CudaError, "test", message);
  if (kind == "NcclError") FERRY_THROW(NcclError, "test", message);
  if (kind == "TimeoutError") FERRY_THROW(TimeoutError, "test", message);
  if (kind == "BootstrapError") FERRY_THROW(BootstrapError, "test", message);
  if (kind == "Interrupted") FERRY_THROW(Interrupted, "test", message);
  throw std::runtime_error(message);
}

// The C++ error family, same messages. Translators run last-registered first, so subclasses come after Error.
void bind_errors(nb::module_& m) {
  nb::exception<Error> error(m, "Error", PyExc_RuntimeError);
  error.attr("__doc__") = "Base of every Ferry error; the message says what happened and what to do.";
  nb::exception<ConfigError>(m, "ConfigError", error).attr("__doc__") =
      "An EpConfig / communicator option that can never work (checked at construction).";
  nb::exception<InputError>(m, "InputError", error).attr("__doc__") =
      "A call argument that is wrong (shape, dtype, device, expert id, token count).";
  nb::exception<CudaError>(m, "CudaError", error).attr("__doc__") = "A CUDA runtime or driver call failed.";
  nb::exception<NcclError>(m, "NcclError", error).attr("__doc__") =
      "An NCCL call failed, or the loaded NCCL differs from the one Ferry was built with.";
  nb::exception<TimeoutError>(m, "TimeoutError", error).attr("__doc__") =
      "A bounded wait expired; the message names the rank that did not arrive.";
  nb::exception<BootstrapError>(m, "BootstrapError", error).attr("__doc__") =
      "The rendezvous between ranks failed: a rank is missing, died, or sent something else.";
  // Ctrl-C in a wait for a late peer: the library asks this check every 100 ms and throws Interrupted when a signal
  // handler raised (its exception, KeyboardInterrupt for SIGINT, is then what Python sees)
  nb::register_exception_translator([](std::exception_ptr const& thrown, void*) {
    try {
      std::rethrow_exception(thrown);
    } catch (Interrupted const& interrupted) {
      if (PyErr_Occurred() == nullptr) PyErr_SetString(PyExc_KeyboardInterrupt, interrupted.what());
    }
  });
  set_interrupt_check([] {
    nb::gil_scoped_acquire gil;
    return PyErr_CheckSignals() != 0;  // runs the handlers (main thread only); nonzero: one raised
  });
  m.def("_raise_for_test", &raise_for_test, "kind"_a, "message"_a,
        "Throws the C++ exception `kind` (tests of the exception translation).");
  m.def("_use_exchange_api", &use_exchange_api, "on"_a,
        "Whether torch tensors and torch's current stream are read through torch's DLPack C exchange API (default) "
        "or its Python-level exports (tests of both ways). Returns whether the loaded torch has the API (False "
        "without torch).");
}

void bind_functions(nb::module_& m) {
  // ---- module functions
  m.def("cuda_available", &cuda_available, "True when this build has the cuda backend and a GPU is visible.");
  m.def("cuda_device_count", &cuda_device_count, "Visible GPUs (0 without the cuda backend).");
  m.def(
      "env_params",
      [] {
        std::vector<std::tuple<std::string, std::string, std::string>> out;
        for (EnvParam const& p : env_params()) out.emplace_back(p.name, p.default_value, p.meaning);
        return out;
      },
      "Every environment parameter Ferry reads: (name, default, meaning).");

  // ---- wire formats (include/ferry/wire_format.hpp; docs/quant.md)
  m.def(
      "wire_payload_bytes",
      [](std::string const& format, int hidden) { return wire_payload_bytes(parse_wire_format(format), hidden); },
      "format"_a, "hidden"_a,
      "Bytes of one row's quantized payload (fp8: hidden, fp4: hidden / 2, bf16: 2 * hidden). ConfigError for an "
      "unknown format or a hidden the format cannot hold.");
  m.def(
      "scale_layout_supported",
      [](std::string const& format, std::string const& layout) {
        return scale_layout_supported(parse_wire_format(format), parse_scale_layout(layout));
      },
      "format"_a, "layout"_a, "Whether recv_scale_layout=layout can hold the scales of the wire format.");
  m.def(
      "scale_tensor_bytes",
      [](std::string const& format, std::string const& layout, int rows, int hidden) {
        return scale_tensor_bytes(parse_wire_format(format), parse_scale_layout(layout), rows, hidden);
      },
      "format"_a, "layout"_a, "rows"_a, "hidden"_a,
      "Bytes of the scale tensor of `rows` rows in `layout`, padding included (one group of expert_scales, or "
      "recv_scales with rows = recv_capacity).");
}

void bind_communicator(nb::module_& m) {
  nb::class_<Communicator>(m, "Communicator",
                           "Rank, world and the symmetric heap shared by the ranks. Create with ferry.init().")
      .def_prop_ro("rank", &Communicator::rank)
      .def_prop_ro("world", &Communicator::world)
      .def_prop_ro(
          "topology", [](Communicator const& c) { return std::make_tuple(c.topology().nodes, c.topology().local); },
          "(nodes, ranks per node): from LOCAL_WORLD_SIZE, FERRY_TOPOLOGY or ferry.init(topology=).")
      .def("load_store_reachable", &Communicator::load_store_reachable, "peer"_a,
           "Whether `peer` is in this rank's NVLink team (cpu: on its emulated node).")
      .def_prop_ro("local_rank", [](Communicator const& c) { return c.bootstrap().local_rank(); })
      .def_prop_ro("local_world", [](Communicator const& c) { return c.bootstrap().local_world(); })
      .def_prop_ro("backend", [](Communicator const& c) { return std::string(backend_name(c.backend())); })
      .def_prop_ro("device", &Communicator::device, "cuda: the GPU ordinal; cpu: -1.")
      .def_prop_ro("failed", &Communicator::failed, "True after a timeout; every later call then raises.")
      .def(
          "barrier",
          [](Communicator& c, nb::handle stream) {
            cudaStream_t const s = stream_from(stream);
            nb::gil_scoped_release release;
            c.barrier(s);
          },
          "stream"_a = nb::none(), "Collective barrier through the transport (enqueued on stream on cuda).")
      .def(
          "check_errors",
          [](Communicator& c, nb::handle stream) {
            cudaStream_t const s = stream_from(stream);
            nb::gil_scoped_release release;
            c.check_errors(s);
          },
          "stream"_a = nb::none(),
          "Raises what a kernel recorded (TimeoutError, InputError for ids dropped on the device); synchronises "
          "stream first on cuda when given.");

  m.def(
      "_init_env",
      [](std::string const& backend, int device, std::string const& topology) {
        SocketBootstrapOptions const options = socket_bootstrap_options_from_env();
        std::unique_ptr<Bootstrap> bootstrap;
        {
          nb::gil_scoped_release release;
          bootstrap = make_socket_bootstrap(options);
        }
        return create_communicator(std::move(bootstrap), backend, device, topology);
      },
      "backend"_a, "device"_a, "topology"_a = "");
  m.def(
      "_init_socket",
      [](std::string const& backend, int device, std::string const& master_addr, int master_port, int rank, int world,
         int local_rank, int local_world, double timeout_s, std::string const& topology) {
        SocketBootstrapOptions options;
        options.master_addr = master_addr;
        options.master_port = master_port;
        options.rank = rank;
        options.world = world;
        options.local_rank = local_rank;
        options.local_world = local_world;
        options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
        std::unique_ptr<Bootstrap> bootstrap;
        {
          nb::gil_scoped_release release;
          bootstrap = make_socket_bootstrap(options);
        }
        return create_communicator(std::move(bootstrap), backend, device, topology);
      },
      "backend"_a, "device"_a, "master_addr"_a, "master_port"_a, "rank"_a, "world"_a, "local_rank"_a, "local_world"_a,
      "timeout_s"_a, "topology"_a = "");
  m.def(
      "_init_python",
      [](nb::object bootstrap, std::string const& backend, int device, std::string const& topology) {
        return create_communicator(make_python_bootstrap(std::move(bootstrap)), backend, device, topology);
      },
      "bootstrap"_a, "backend"_a, "device"_a, "topology"_a = "");
}

void bind_config(nb::module_& m) {
  EpConfig const defaults;
  nb::class_<EpConfig>(m, "EpConfig", "The shape of one MoE layer's communication (resolved for the world size).")
      .def_ro("hidden", &EpConfig::hidden)
      .def_ro("num_experts", &EpConfig::num_experts)
      .def_ro("topk", &EpConfig::topk)
      .def_ro("max_tokens_per_rank", &EpConfig::max_tokens_per_rank)
      .def_ro("expert_capacity", &EpConfig::expert_capacity)
      .def_ro("max_recv_tokens", &EpConfig::max_recv_tokens)
      .def_prop_ro("dispatch_format",
                   [](EpConfig const& c) { return std::string(wire_format_name(c.dispatch_format)); })
      .def_prop_ro("combine_format", [](EpConfig const& c) { return std::string(wire_format_name(c.combine_format)); })
      .def_ro("dispatch_dequantize", &EpConfig::dispatch_dequantize)
      .def_prop_ro("recv_scale_layout",
                   [](EpConfig const& c) { return std::string(scale_layout_name(c.recv_scale_layout)); })
      .def_prop_ro("delivers_quantized", &EpConfig::delivers_quantized,
                   "True when dispatch delivers the quantized payload + scales (a quantized dispatch_format without "
                   "dispatch_dequantize).")
      .def_prop_ro("recv_row_bytes", &EpConfig::recv_row_bytes,
                   "Bytes of one delivered row: hidden * 2 (bf16) or the quantized payload.")
      .def_prop_ro("mode", [](EpConfig const& c) { return std::string(mode_name(c.mode)); })
      .def_prop_ro(
          "internode_route", [](EpConfig const& c) { return std::string(internode_route_name(c.internode_route)); },
          "Across nodes, mode='ll': 'automatic', 'forward' or 'direct' (docs/internode.md).")
      .def_ro("rank_masking", &EpConfig::rank_masking,
              "mode='ll': a rank that times out (or is asked out with mask_ranks) is masked instead of failing every "
              "call (docs/internode.md, 'Rank masking'); both backends (cuda: up to 32 ranks, across nodes the direct "
              "route).")
      .def_ro("wait_stats", &EpConfig::wait_stats,
              "mode='ll': per-source wait statistics of the receive halves (EpBuffer.wait_stats()).")
      .def_prop_ro(
          "dispatch_geometry", [](EpConfig const& c) { return geometry_to(c.dispatch_geometry); },
          "The pinned dispatch CTA count (0: choose), or None.")
      .def_prop_ro(
          "combine_geometry", [](EpConfig const& c) { return geometry_to(c.combine_geometry); },
          "The pinned combine CTA count (0: choose), or None.")
      .def("__repr__", [](EpConfig const& c) {
        return concat("EpConfig(hidden=", c.hidden, ", num_experts=", c.num_experts, ", topk=", c.topk,
                      ", max_tokens_per_rank=", c.max_tokens_per_rank,
                      ", expert_capacity=", c.expert_capacity ? std::to_string(*c.expert_capacity) : "None",
                      ", max_recv_tokens=", c.max_recv_tokens ? std::to_string(*c.max_recv_tokens) : "None",
                      ", dispatch_format='", wire_format_name(c.dispatch_format), "', combine_format='",
                      wire_format_name(c.combine_format),
                      "', dispatch_dequantize=", c.dispatch_dequantize ? "True" : "False", ", recv_scale_layout='",
                      scale_layout_name(c.recv_scale_layout), "', mode='", mode_name(c.mode), "')");
      });
}

// Dispatch results and handles.
void bind_results(nb::module_& m) {
  nb::class_<PyDispatchResult>(
      m, "DispatchResult",
      "Views of the EpBuffer's buffers filled by one dispatch (zero-copy; valid until the next dispatch). Rows are "
      "ordered by (source rank, source token). Eager calls slice the rank-major views to num_recv_host rows; "
      "otherwise they span recv_capacity rows and the count stays on the device (num_recv).")
      .def_ro("recv_x", &PyDispatchResult::recv_x,
              "[rows, hidden] bf16 (uint16 bits on NumPy); quantized delivery: the payload, fp8 [rows, hidden] "
              "float8_e4m3fn (uint8 on NumPy), fp4 [rows, hidden / 2] uint8")
      .def_ro("recv_topk_idx", &PyDispatchResult::recv_topk_idx, "[rows, topk] int32 local expert, -1 elsewhere")
      .def_ro("recv_topk_weights", &PyDispatchResult::recv_topk_weights, "[rows, topk] float32")
      .def_ro("recv_src", &PyDispatchResult::recv_src, "[rows, 2] int32 (source rank, source token)")
      .def_ro("num_recv", &PyDispatchResult::num_recv, "[1] int32 rows received, where the data lives")
      .def_ro("num_recv_host", &PyDispatchResult::num_recv_host, "rows received as an int (eager), else None")
      .def_ro("expert_counts", &PyDispatchResult::expert_counts, "[num_local_experts] int32 entries per expert")
      .def_ro("expert_x", &PyDispatchResult::expert_x,
              "[num_local_experts, expert_capacity, hidden] bf16 (expand), or the quantized payload as recv_x")
      .def_ro("expert_src_row", &PyDispatchResult::expert_src_row,
              "[num_local_experts, expert_capacity] int32 rank-major row of each slot (expand)")
      .def_ro("recv_scales", &PyDispatchResult::recv_scales,
              "Quantized delivery (normal mode): the block scales of recv_x in recv_scale_layout (docs/python.md), "
              "else None")
      .def_ro("recv_token_scales", &PyDispatchResult::recv_token_scales,
              "nvfp4 delivery: [rows] float32 per-token scales, else None")
      .def_ro("expert_scales", &PyDispatchResult::expert_scales,
              "Quantized delivery with expand: one scale tensor per local expert, [num_local_experts, ...], else None")
      .def_ro("expert_token_scales", &PyDispatchResult::expert_token_scales,
              "nvfp4 delivery with expand: [num_local_experts, expert_capacity] float32, else None")
      .def_ro("recv_capacity", &PyDispatchResult::recv_capacity)
      .def_ro("expert_slots", &PyDispatchResult::expert_slots)
      .def_ro("masked_entries", &PyDispatchResult::masked_entries,
              "Rank masking: this call's (token, k) entries of this rank's tokens not sent (their rank is masked).")
      .def_ro("dropped_rows", &PyDispatchResult::dropped_rows,
              "Rows this call did not deliver over every rank (a receive capacity or expert_capacity exceeded; the "
              "same on every rank): > 0 only on a lazy call, whose drop the next check raises and over whose layout "
              "every combine is refused; -1 when only the device knows (cuda, lazy).");

  nb::class_<PyDispatchHandle>(
      m, "DispatchHandle",
      "The routing layout of one normal-mode dispatch, kept for later calls (training): made by "
      "EpBuffer.make_handle(), filled by dispatch(..., save_handle=h), read by a cached dispatch (dispatch(x, "
      "handle=h)), combine(..., handle=h), dispatch_backward and combine_backward. It fits every EpBuffer of the "
      "same communicator and layout shape (num_experts, topk, max_tokens_per_rank, recv_capacity, expert_capacity), "
      "whatever its hidden size, and may outlive the EpBuffer that made it. Its storage is a torch uint8 tensor "
      "(cuda backend with torch) or host memory (cpu).")
      .def_prop_ro(
          "saved", [](PyDispatchHandle const& h) { return h.handle.saved(); },
          "True once a dispatch saved its layout into it.")
      .def_prop_ro(
          "num_tokens", [](PyDispatchHandle const& h) { return h.handle.num_tokens(); },
          "Tokens of the dispatch that saved it (0 before).")
      .def_prop_ro(
          "expanded", [](PyDispatchHandle const& h) { return h.handle.expanded(); },
          "True when that dispatch filled the expert-major layout (expand=True).")
      .def_prop_ro(
          "num_recv_host",
          [](PyDispatchHandle const& h) {
            return h.num_recv_host >= 0 ? std::optional<int64_t>(h.num_recv_host) : std::nullopt;
          },
          "Rows that dispatch received, when it knew them on the host (eager; cpu always), else None.")
      .def_prop_ro(
          "bytes", [](PyDispatchHandle const& h) { return h.handle.bytes(); },
          "Device bytes of its storage (0 on the cpu backend).")
      .def_ro("storage", &PyDispatchHandle::storage,
              "The torch uint8 tensor holding it on the device, or None (cpu backend; cuda without torch: the "
              "library's own allocation).");
}

// EpBuffer: construction and the calls.
nb::class_<PyEpBuffer> bind_ep_buffer(nb::module_& m) {
  EpConfig const defaults;
  nb::class_<PyEpBuffer> cls(m, "EpBuffer",
                             "Dispatch and combine of one MoE layer's tokens (collective: every rank creates it with "
                             "the same arguments).");
  cls.def(
         "__init__",
         [](PyEpBuffer* self, std::shared_ptr<Communicator> comm, int hidden, int num_experts, int topk,
            int max_tokens_per_rank, std::optional<int> expert_capacity, std::optional<int> max_recv_tokens,
            std::string const& dispatch_format, std::string const& combine_format, bool dispatch_dequantize,
            std::string const& recv_scale_layout, std::string const& mode, std::optional<int> dispatch_geometry,
            std::optional<int> combine_geometry, std::string const& internode_route, bool rank_masking,
            bool wait_stats) {
           EpConfig const config =
               make_config(hidden, num_experts, topk, max_tokens_per_rank, expert_capacity, max_recv_tokens,
                           dispatch_format, combine_format, dispatch_dequantize, recv_scale_layout, mode,
                           dispatch_geometry, combine_geometry, internode_route, rank_masking, wait_stats);
           new (self) PyEpBuffer(std::move(comm), config);
         },
         "comm"_a, nb::kw_only(), "hidden"_a = defaults.hidden, "num_experts"_a = defaults.num_experts,
         "topk"_a = defaults.topk, "max_tokens_per_rank"_a = defaults.max_tokens_per_rank,
         "expert_capacity"_a = nb::none(), "max_recv_tokens"_a = nb::none(), "dispatch_format"_a = "bf16",
         "combine_format"_a = "bf16", "dispatch_dequantize"_a = defaults.dispatch_dequantize,
         "recv_scale_layout"_a = scale_layout_name(defaults.recv_scale_layout), "mode"_a = "normal",
         "dispatch_geometry"_a = nb::none(), "combine_geometry"_a = nb::none(),
         "internode_route"_a = internode_route_name(defaults.internode_route), "rank_masking"_a = defaults.rank_masking,
         "wait_stats"_a = defaults.wait_stats)
      .def_static(
          "footprint",
          [](int world, int nodes, std::string const& backend, int hidden, int num_experts, int topk,
             int max_tokens_per_rank, std::optional<int> expert_capacity, std::optional<int> max_recv_tokens,
             std::string const& dispatch_format, std::string const& combine_format, bool dispatch_dequantize,
             std::string const& recv_scale_layout, std::string const& mode, std::string const& internode_route,
             bool rank_masking) {
            FERRY_CHECK_CONFIG(nodes >= 1 && world >= 1 && world % nodes == 0, "world=", world, " and nodes=", nodes,
                               ": world must be a positive multiple of nodes");
            EpConfig const config =
                make_config(hidden, num_experts, topk, max_tokens_per_rank, expert_capacity, max_recv_tokens,
                            dispatch_format, combine_format, dispatch_dequantize, recv_scale_layout, mode, std::nullopt,
                            std::nullopt, internode_route, rank_masking, false);
            BufferFootprint const f = buffer_footprint(config, Topology{nodes, world / nodes}, parse_backend(backend));
            nb::dict out;
            out["symmetric"] = f.symmetric;
            out["local"] = f.local;
            out["total"] = f.total();
            out["description"] = f.description;
            return out;
          },
          "world"_a, nb::kw_only(), "nodes"_a = 1, "backend"_a = "cuda", "hidden"_a = defaults.hidden,
          "num_experts"_a = defaults.num_experts, "topk"_a = defaults.topk,
          "max_tokens_per_rank"_a = defaults.max_tokens_per_rank, "expert_capacity"_a = nb::none(),
          "max_recv_tokens"_a = nb::none(), "dispatch_format"_a = "bf16", "combine_format"_a = "bf16",
          "dispatch_dequantize"_a = defaults.dispatch_dequantize,
          "recv_scale_layout"_a = scale_layout_name(defaults.recv_scale_layout), "mode"_a = "normal",
          "internode_route"_a = internode_route_name(defaults.internode_route),
          "rank_masking"_a = defaults.rank_masking,
          "The bytes an EpBuffer of these arguments holds on each rank of `world` ranks (`nodes` nodes) on `backend`: "
          "{symmetric, local, total, description}, the formula its constructor checks against the free memory "
          "(not collective; ConfigError where the constructor would refuse the config).")
      .def("dispatch", &PyEpBuffer::dispatch, "x"_a, "topk_idx"_a = nb::none(), "topk_weights"_a = nb::none(),
           nb::kw_only(), "x_scales"_a = nb::none(), "x_token_scales"_a = nb::none(), "expand"_a = false,
           "eager"_a = true, "return_recv_hook"_a = false, "save_handle"_a = nb::none(), "handle"_a = nb::none(),
           "stream"_a = nb::none(), "x_repeat"_a = 1,
           "Sends each token to the ranks of its experts. x [T, hidden] bf16, topk_idx [T, topk] int32/int64 "
           "(global ids, -1 = none), topk_weights [T, topk] float32. Returns a DispatchResult of views. "
           "Pre-quantized input (a quantized dispatch_format): x the payload (fp8 [T, hidden] float8_e4m3fn or "
           "uint8; fp4 [T, hidden / 2] uint8), x_scales [T, num_scales] (float32 for fp8, uint8 otherwise), "
           "x_token_scales [T] float32 (nvfp4). "
           "return_recv_hook (mode='ll'): return after the send half; complete_dispatch() runs the receive half. "
           "save_handle=h (normal mode): also save this dispatch's layout into the DispatchHandle h. handle=h: a "
           "cached dispatch, routed by h's saved layout (topk_idx and topk_weights None, T = h.num_tokens). "
           "x_repeat=r (mode='ll'): token i sends row i // r of x, which has T / r rows (topk_idx and topk_weights "
           "have T): every (token, k) entry sent as a token of its own without copying x r times.")
      .def("combine", &PyEpBuffer::combine, "x"_a, "layout"_a = "expert", nb::kw_only(), "out"_a = nb::none(),
           "eager"_a = true, "return_recv_hook"_a = false, "handle"_a = nb::none(), "stream"_a = nb::none(),
           "group"_a = 1, "group_weights"_a = nb::none(),
           "Brings the expert outputs of the last dispatch back: layout='expert' takes [num_local_experts, "
           "expert_capacity, hidden] and applies the weights; layout='rank' takes [num_recv, hidden] rows already "
           "reduced. Returns out (allocated when None) [T, hidden] bf16. return_recv_hook (mode='ll'): return "
           "after the send half; out is filled by complete_combine(). handle=h (normal mode): combine the rows of the "
           "dispatch h saved instead of the last one (T = h.num_tokens); h's layout becomes the current one. "
           "group=g, group_weights [T / g, g] float32 (mode='ll', topk 1): out [T / g, hidden] holds the weighted "
           "sums of groups of g consecutive tokens, in fp32 rounded once (CombineArgs::group), the way an "
           "entry-per-token dispatch (x_repeat=g) is combined back into its tokens.")
      .def(
          "make_handle", [](PyEpBuffer const& b) { return b.make_handle(); },
          "A DispatchHandle for this buffer's layout shape (normal mode; ConfigError for mode='ll'). Not collective; "
          "on the cuda backend its storage is a torch uint8 tensor of handle_bytes() on this GPU (torch's caching "
          "allocator, on the current stream).")
      .def("rank_counts", &PyEpBuffer::rank_counts, "handle"_a, nb::kw_only(), "out"_a = nb::none(),
           "stream"_a = nb::none(),
           "The count matrix of the dispatch that saved handle: [world, world] int32, entry [s, d] = rows rank s sent "
           "to rank d (its prefix sum over s is DeepEP's rank_prefix_matrix). Into out when given, else a new array "
           "(torch on this buffer's device when torch is loaded, else NumPy). Local; ConfigError on a backend whose "
           "handles do not keep it.")
      .def_prop_ro(
          "handle_bytes", [](PyEpBuffer const& b) { return b.buffer().handle_bytes(); },
          "Device bytes of one DispatchHandle (0 on the cpu backend, whose handles live in host memory).")
      .def("dispatch_backward", &PyEpBuffer::dispatch_backward, "grad"_a, "handle"_a, "layout"_a = "expert",
           nb::kw_only(), "out"_a = nb::none(), "fp32"_a = false, "eager"_a = true, "stream"_a = nb::none(),
           "The backward pass of the dispatch that saved handle (a combine leg without weights): grad is the "
           "gradient of what it delivered, layout='expert' of expert_x [num_local_experts, expert_capacity, "
           "hidden] (the handle must be expanded), layout='rank' of recv_x [>= num_recv, hidden], bf16. Returns out "
           "(allocated when None) [T, hidden]: bf16, or float32 with fp32=True (the fp32 sum, not rounded): "
           "grad_x[t] = the sum of the gradients of every copy of token t. The gradient of topk_weights through "
           "dispatch is 0 (dispatch does not use them).")
      .def("combine_backward", &PyEpBuffer::combine_backward, "grad_y"_a, "handle"_a, "layout"_a = "expert",
           nb::kw_only(), "x"_a = nb::none(), "want_grad_weights"_a = nb::none(), "grad_topk_weights"_a = nb::none(),
           "eager"_a = true, "stream"_a = nb::none(),
           "The backward pass of a combine of the dispatch that saved handle (a cached dispatch of grad_y [T, "
           "hidden] bf16). Returns (rows, grad_topk_weights): rows, views of this buffer valid until its next "
           "dispatch, are layout='rank' recv_x (row of (s, t) = grad_y[t] of s) or layout='expert' expert_x (slot of "
           "entry (t, k) = bf16(w[t, k] * grad_y[t]), unfilled slots 0). grad_topk_weights (layout='expert', "
           "want_grad_weights None or True; needs x, the forward combine's expert outputs [num_local_experts, "
           "expert_capacity, hidden] bf16): [T, topk] float32, <grad_y[t], x of the slot of (t, k)> (0 for an id of "
           "-1 or an entry without a slot), written into grad_topk_weights when given; else None.")
      .def("dispatch_owned", &PyEpBuffer::dispatch_owned, "x"_a, "topk_idx"_a.none() = nb::none(),
           "topk_weights"_a.none() = nb::none(), nb::kw_only(), "x_scales"_a.none() = nb::none(), "eager"_a = true,
           "save_handle"_a = false, "handle"_a.none() = nb::none(), "stream"_a = nb::none(), "with_src"_a = false,
           "A normal-mode dispatch of torch tensors whose rank-major outputs are fresh torch tensors the caller owns "
           "(torch's allocator, on the current stream), valid after later dispatches, filled in one launch: "
           "(recv_x, recv_scales or None, recv_topk_idx (topk_idx's dtype), recv_topk_weights, expert counts as a "
           "list (eager) or None, the DispatchHandle saved into (save_handle=True) or None, num_recv [1] int32 (a "
           "view), with with_src=True recv_src [rows, 2] int32 (source rank, source token) else None). eager: "
           "exactly num_recv rows; lazy: recv_capacity rows, those at or past num_recv unspecified. "
           "handle=h: a cached dispatch (no ids or weights; they and the counts come back None). Refusals as "
           "dispatch().")
      .def("complete_dispatch", &PyEpBuffer::complete_dispatch, "stream"_a = nb::none(),
           "The receive half of a dispatch made with return_recv_hook; returns its DispatchResult.")
      .def("complete_combine", &PyEpBuffer::complete_combine, "stream"_a = nb::none(),
           "The receive half of a combine made with return_recv_hook (fills its out).")
      .def_prop_ro(
          "pending_hook", [](PyEpBuffer const& b) { return std::string(b.buffer().pending_hook()); },
          "The leg whose receive half is pending ('dispatch', 'combine', or '' when none).");
  return cls;
}

// EpBuffer: what it reports (paths, bytes, masks, wait statistics) and its sizes.
void bind_ep_buffer_state(nb::class_<PyEpBuffer>& cls) {
  cls.def(
         "explain", [](PyEpBuffer const& b) { return b.buffer().explain(); },
         "The kernel path the last call of each leg took, and why.")
      .def(
          "link_bytes",
          [](PyEpBuffer const& b, nb::object stream) {
            cudaStream_t const s = stream_from(stream);
            CallLinkBytes bytes;
            {
              nb::gil_scoped_release release;
              bytes = b.buffer().link_bytes(s);
            }
            auto const leg = [](LinkBytes const& l) {
              nb::dict d;
              d["network_bytes"] = l.network_bytes;
              d["nvlink_bytes"] = l.nvlink_bytes;
              d["network_messages"] = l.network_messages;
              return d;
            };
            nb::dict out;
            out["dispatch"] = leg(bytes.dispatch);
            out["combine"] = leg(bytes.combine);
            return out;
          },
          "stream"_a = nb::none(),
          "The bytes this rank sent in its last dispatch and combine, by link: {'dispatch': {...}, 'combine': "
          "{...}} with network_bytes, nvlink_bytes, network_messages (rows and their metadata; docs/internode.md). "
          "Synchronises stream on cuda.")
      .def(
          "mask_status",
          [](PyEpBuffer const& b) {
            MaskStatus const s = b.buffer().mask_status();
            nb::dict d;
            d["enabled"] = s.enabled;
            d["ranks"] = s.ranks;
            d["self"] = s.self;
            d["dispatch_entries"] = s.dispatch_entries;
            d["combine_entries"] = s.combine_entries;
            d["last_dispatch_entries"] = s.last_dispatch_entries;
            d["last_combine_entries"] = s.last_combine_entries;
            return d;
          },
          "Rank masking on this rank (local): {'enabled', 'ranks' (masked, ascending; this rank too once masked), "
          "'self' (this rank is masked: its calls raise Error until clear_mask), 'dispatch_entries', "
          "'combine_entries' ((token, k) entries of this rank's tokens left out because their expert's rank is "
          "masked, since the buffer was made or cleared), 'last_dispatch_entries', 'last_combine_entries'}.")
      .def(
          "masked_ranks", [](PyEpBuffer const& b) { return b.buffer().masked_ranks(); },
          "The masked ranks, ascending (local; [] when masking is off).")
      .def(
          "mask_ranks", [](PyEpBuffer& b, std::vector<int> const& ranks) { b.buffer().mask_ranks(ranks); }, "ranks"_a,
          "Local: asks that these ranks be masked from this rank's next dispatch or combine on (every rank of that "
          "call applies the union of the requests). ConfigError when masking is off, InputError for a bad rank.")
      .def(
          "clear_mask",
          [](PyEpBuffer& b) {
            nb::gil_scoped_release release;  // collective over every rank (the bootstrap)
            b.buffer().clear_mask();
          },
          "Collective over every rank, masked ones included: unmasks every rank and zeroes the counts. The dispatch "
          "before it is forgotten (dispatch again before a combine).")
      .def(
          "wait_stats",
          [](PyEpBuffer const& b, nb::object stream) {
            cudaStream_t const s = stream_from(stream);
            WaitStats stats;
            {
              nb::gil_scoped_release release;
              stats = b.buffer().wait_stats(s);
            }
            auto const leg = [](std::vector<PeerWaitStats> const& peers) {
              nb::list out;
              for (PeerWaitStats const& p : peers) {
                nb::dict d;
                d["waits"] = p.waits;
                d["total_ns"] = p.total_ns;
                d["max_ns"] = p.max_ns;
                out.append(d);
              }
              return out;
            };
            nb::dict out;
            out["dispatch"] = leg(stats.dispatch);
            out["combine"] = leg(stats.combine);
            return out;
          },
          "stream"_a = nb::none(),
          "Per-source wait statistics (wait_stats=True): {'dispatch': [...], 'combine': [...]}, one dict per source "
          "rank with waits, total_ns, max_ns. Synchronises stream on cuda. ConfigError when off.")
      .def(
          "reset_wait_stats",
          [](PyEpBuffer& b, nb::object stream) {
            cudaStream_t const s = stream_from(stream);
            nb::gil_scoped_release release;
            b.buffer().reset_wait_stats(s);
          },
          "stream"_a = nb::none(), "Zeroes the wait statistics (enqueued on stream on cuda).")
      .def_prop_ro("config", [](PyEpBuffer const& b) { return b.buffer().config(); })
      .def_prop_ro("num_local_experts", &PyEpBuffer::num_local_experts)
      .def_prop_ro("recv_capacity", &PyEpBuffer::recv_capacity)
      .def_prop_ro("expert_capacity", &PyEpBuffer::expert_slots)
      .def("_time_cpp_loop", &PyEpBuffer::time_cpp_loop, "iters"_a, "x"_a, "topk_idx"_a, "topk_weights"_a, "expand"_a,
           "combine_x"_a, "layout"_a, "out"_a, "eager"_a, "stream"_a = nb::none(),
           "Host seconds of iters dispatch + combine pairs in a C++ loop (for bench_overhead.py).");
}

// What Ferry's tuning says of a leg's CTA count (docs/tuning.md), without an EpBuffer: FERRY_*_BLOCKS, else the
// table row of this key in the bucket of num_tokens. (0, why) when neither speaks (the kernels' default applies).
std::pair<int, std::string> tuned_blocks(std::string const& leg_name, std::string const& gpu, int world, int hidden,
                                         int topk, std::string const& dispatch_format, std::string const& mode,
                                         int num_tokens) {
  FERRY_CHECK_INPUT(leg_name == "dispatch" || leg_name == "combine", "leg='", leg_name,
                    "' is not 'dispatch' or 'combine'");
  tuning::Leg const leg = leg_name == "dispatch" ? tuning::Leg::dispatch : tuning::Leg::combine;
  tuning::EnvPin const env = tuning::read_env_pin(leg);
  if (env.blocks) return {*env.blocks, concat("FERRY_", leg_name == "dispatch" ? "DISPATCH" : "COMBINE", "_BLOCKS")};
  EpConfig config;
  config.hidden = hidden;
  config.topk = topk;
  config.dispatch_format = parse_wire_format(dispatch_format);
  config.mode = parse_mode(mode);
  tuning::LegTuning const tuned =
      tuning::resolve_leg(leg, detail::tuning_key(gpu, world, config), std::nullopt, *tuning::active_tables());
  tuning::BucketMatch const match = tuning::match_bucket(tuned.rows, num_tokens);
  if (match.bucket == nullptr) return {0, tuned.rows_from};
  return {match.bucket->geometry.blocks, tuned.rows_from};
}

// The launcher (ferry.launch).
void bind_launcher(nb::module_& m) {
  m.def(
      "_launch_ranks",
      [](std::vector<std::string> argv, int nproc, std::string const& master_addr, int master_port,
         std::vector<std::pair<std::string, std::string>> env, double timeout_s, std::optional<double> grace_s) {
        LaunchOptions options;
        options.argv = std::move(argv);
        options.nproc = nproc;
        options.master_addr = master_addr;
        options.master_port = master_port;
        options.env = std::move(env);
        options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
        if (grace_s) options.grace = std::chrono::milliseconds(static_cast<int64_t>(*grace_s * 1000.0));
        LaunchResult result;
        {
          nb::gil_scoped_release release;
          result = launch_ranks(options);
        }
        std::vector<int> codes;
        for (RankExit const& rank : result.ranks) codes.push_back(rank.signal ? -rank.signal : rank.exit_code);
        return std::make_tuple(result.ok(), result.describe(), codes, result.exit_status());
      },
      "argv"_a, "nproc"_a, "master_addr"_a, "master_port"_a, "env"_a, "timeout_s"_a, "grace_s"_a.none(),
      "Runs argv as nproc ranks (core/launcher.hpp); grace_s None: FERRY_TIMEOUT_S + 5. Returns (ok, one line per "
      "failed rank, each rank's exit code or -signal, the exit status of the rank that failed first).");
}

}  // namespace
}  // namespace ferry::python

NB_MODULE(_ext, m) {
  using namespace ferry::python;
  m.doc() = "Ferry's C++ API (include/ferry/) for Python; use the ferry package, not this module directly";
  m.attr("__version__") = FERRY_VERSION;
  m.attr("cuda_backend_compiled") = static_cast<bool>(FERRY_HAVE_CUDA);
  // NOTE: nanobind lists, when the interpreter exits, the instances still alive after its own state is torn down. A
  // torch view of an EpBuffer's memory (the cached views of the last dispatch, or a result the program kept) holds
  // the EpBuffer and through it the Communicator, and the torch tensors still alive at exit are released only after
  // that teardown, so with the report on every such program prints "nanobind: leaked 1 instances! ...
  // Communicator" and a hint of a reference-counting bug in the binding. Nothing leaks while the program runs (an
  // EpBuffer dropped with its views is freed), and freeing the buffers at exit would mean CUDA and NCCL calls during
  // process teardown.
  nb::set_leak_warnings(false);
  bind_errors(m);
  bind_functions(m);
  bind_communicator(m);
  bind_config(m);
  bind_results(m);
  nb::class_<PyEpBuffer> ep_buffer = bind_ep_buffer(m);
  bind_ep_buffer_state(ep_buffer);
  bind_launcher(m);
  m.def("_tuned_blocks", &tuned_blocks, "leg"_a, "gpu"_a, "world"_a, "hidden"_a, "topk"_a, "dispatch_format"_a,
        "mode"_a, "num_tokens"_a,
        "(CTAs, source) Ferry's tuning gives a leg of this shape (FERRY_*_BLOCKS, else the table row in the bucket "
        "of num_tokens), or (0, why none applies): what ferry.deep_ep's get_theoretical_num_sms reads.");
}
