// PyEpBuffer: the EpBuffer's calls with Python arguments. Each call converts and checks its arguments (a refusal
// joins the call's exchange, so every rank raises), runs the C++ call with the GIL released, and returns views of the
// buffer's memory, cached per framework.
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "binding.hpp"

namespace ferry::python {

using detail::concat;
using namespace nb::literals;

namespace {

// A torch input of one of the given one-byte float dtypes (None: none) as a uint8 view of the same memory, so that
// its import does not depend on whether torch's DLPack knows the type; anything else as it is.
nb::object torch_bytes(nb::handle object, Framework framework, nb::handle dtype) {
  if (framework == kTorch && !dtype.is_none() && object.attr("dtype").is(dtype))
    return object.attr("view")(frameworks().torch_uint8);
  return nb::borrow(object);
}

// The C++ API tells "given" by a non-null pointer; an empty array may have none.
void const* nonnull(void const* data) {
  alignas(16) static float const kEmpty[4] = {};
  return data ? data : kEmpty;
}

PyDispatchHandle* handle_arg(nb::handle object, char const* name) {
  if (object.is_none()) return nullptr;
  PyDispatchHandle* handle = nullptr;
  FERRY_CHECK_INPUT(nb::try_cast(object, handle, /*convert=*/false) && handle != nullptr, name,
                    " must be a ferry.DispatchHandle (EpBuffer.make_handle()), got ", python_type_name(object));
  return handle;
}

PyDispatchHandle* required_handle(nb::handle object, char const* call) {
  PyDispatchHandle* const handle = handle_arg(object, "handle");
  FERRY_CHECK_INPUT(handle != nullptr, call, " needs handle, the forward dispatch's DispatchHandle (filled by ",
                    "dispatch(..., save_handle=h))");
  return handle;
}

bool expert_layout(std::string const& layout, char const* call) {
  FERRY_CHECK_INPUT(layout == "expert" || layout == "rank", call, " layout='", layout, "' is not a layout; use ",
                    "'expert' (expert-major rows [num_local_experts, expert_capacity, hidden]) or 'rank' ",
                    "(rank-major rows [num_recv, hidden])");
  return layout == "expert";
}

nb::object head(nb::object const& full, int64_t rows) {
  if (full.is_none()) return full;
  nb::object const slice = nb::steal(PySlice_New(nullptr, nb::int_(rows).ptr(), nullptr));
  PyObject* const part = PyObject_GetItem(full.ptr(), slice.ptr());
  if (!part) throw nb::python_error();
  return nb::steal(part);
}

bool same_result(PyDispatchResult const& a, PyDispatchResult const& b) {
  return a.recv_x.is(b.recv_x) && a.recv_topk_idx.is(b.recv_topk_idx) && a.recv_topk_weights.is(b.recv_topk_weights) &&
         a.recv_src.is(b.recv_src) && a.num_recv.is(b.num_recv) && a.expert_counts.is(b.expert_counts) &&
         a.expert_x.is(b.expert_x) && a.expert_src_row.is(b.expert_src_row) && a.recv_scales.is(b.recv_scales) &&
         a.recv_token_scales.is(b.recv_token_scales) && a.expert_scales.is(b.expert_scales) &&
         a.expert_token_scales.is(b.expert_token_scales) && a.num_recv_host == b.num_recv_host &&
         a.recv_capacity == b.recv_capacity && a.expert_slots == b.expert_slots &&
         a.masked_entries == b.masked_entries && a.dropped_rows == b.dropped_rows;
}

// Fresh torch tensors on a device (torch's allocator: on cuda its caching allocator, on the current stream), for
// dispatch_owned to fill.
class Owned {
 public:
  explicit Owned(nb::object device) : device_(std::move(device)) {}

  nb::object empty(int64_t rows, int64_t cols, nb::dlpack::dtype dtype) const {
    Frameworks const& f = frameworks();
    nb::handle const type = dtype == kBf16  ? f.torch_bf16
                            : dtype == kF32 ? f.torch_f32
                            : dtype == kI32 ? f.torch_int32
                            : dtype == kI64 ? f.torch_int64
                            : dtype == kFp8 ? f.torch_fp8_e4m3fn
                                            : f.torch_uint8;
    return f.torch_empty(nb::make_tuple(rows, cols), "dtype"_a = type, "device"_a = device_);
  }

  // The data pointer of a tensor made by empty(): through torch's C exchange API where torch has it (no Python
  // call), else Tensor.data_ptr().
  static void* data_of(nb::handle tensor) {
    if (nb::dlpack::dltensor t; torch_dltensor(tensor, t)) return ArrayArg(t).data();
    return reinterpret_cast<void*>(nb::cast<uintptr_t>(tensor.attr("data_ptr")()));
  }

 private:
  nb::object device_;
};

}  // namespace

// NOTE: an EpBuffer belongs to one host thread; with the GIL released two Python threads could enter it at once.
class PyEpBuffer::Exclusive {
 public:
  explicit Exclusive(PyEpBuffer& owner) : owner_(owner) {
    FERRY_CHECK_INPUT(!owner_.busy_.exchange(true), "this EpBuffer is in use by another thread; an EpBuffer ",
                      "belongs to one thread (create one per thread)");
  }
  ~Exclusive() { owner_.busy_.store(false); }
  Exclusive(Exclusive const&) = delete;
  Exclusive& operator=(Exclusive const&) = delete;

 private:
  PyEpBuffer& owner_;
};

PyEpBuffer::PyEpBuffer(std::shared_ptr<Communicator> comm, EpConfig const& config)
    : placement_(comm ? comm->backend() : Backend::cpu, comm ? comm->device() : -1) {
  FERRY_CHECK_CONFIG(comm != nullptr, "EpBuffer needs a communicator");
  {
    nb::gil_scoped_release release;  // collective (symmetric allocations through the bootstrap)
    buffer_ = std::make_shared<EpBuffer>(std::move(comm), config);
  }
  EpConfig const& resolved = buffer_->config();
  int const world = buffer_->communicator().world();
  hidden_ = resolved.hidden;
  topk_ = resolved.topk;
  num_local_ = resolved.num_local_experts(world);
  capacity_ = resolved.recv_capacity(world);
  slots_ = resolved.expert_slots();
  max_tokens_ = resolved.max_tokens_per_rank;
  format_ = resolved.dispatch_format;
  wire_ = wire_row_layout(format_, hidden_);
  scale_layout_ = resolved.recv_scale_layout;
  quantized_ = resolved.delivers_quantized();
  size_t const cap = static_cast<size_t>(capacity_);
  size_t const local = static_cast<size_t>(num_local_);
  size_t const slots = static_cast<size_t>(slots_);
  recv_x_spec_ = row_spec(0, cap, resolved.recv_row_bytes());
  expert_x_spec_ = row_spec(local, slots, resolved.recv_row_bytes());
  if (quantized_) {
    recv_scales_spec_ = scale_spec(0, capacity_);
    expert_scales_spec_ = scale_spec(local, slots_);
  }
  // Every view holds this capsule: the EpBuffer (and its communicator) live as long as any view of its memory.
  owner_ = nb::capsule(new std::shared_ptr<EpBuffer>(buffer_),
                       [](void* p) noexcept { delete static_cast<std::shared_ptr<EpBuffer>*>(p); });
}

// ---- dispatch -------------------------------------------------------------------------------------------------------

// Converts and checks dispatch arguments (no C++ call). Pre-quantized input (x_scales given, a quantized
// dispatch_format): x is the payload, one byte per element (fp8) or two elements per byte (fp4), x_scales the block
// scales [num_tokens, num_scales], x_token_scales nvfp4's per-token scales. x_scales with bf16, or x_token_scales
// where it does not belong, go to the C++ call as given: it refuses them with its own message.
// cached: a cached dispatch (DispatchArgs::handle), which routes by the handle's ids and weights: topk_idx and
// topk_weights are None there (given ones go to the C++ call as they are, which refuses them).
PyEpBuffer::Inputs PyEpBuffer::dispatch_inputs(nb::handle x, nb::handle topk_idx, nb::handle topk_weights,
                                               nb::handle x_scales, nb::handle x_token_scales, bool expand, bool eager,
                                               nb::handle stream, bool return_recv_hook, bool cached,
                                               int x_repeat) const {
  Inputs in;
  in.framework = framework_of(x);
  ArrayArg const xa = import_x(in, x, !x_scales.is_none() && format_ != WireFormat::bf16);
  // x_repeat (mode='ll'): token i sends row i // x_repeat of x, so x has num_tokens / x_repeat rows
  FERRY_CHECK_INPUT(x_repeat >= 1, "x_repeat=", x_repeat, " must be >= 1 and divide num_tokens");
  int64_t const x_rows = static_cast<int64_t>(xa.shape(0));
  int64_t const num_tokens = x_rows * x_repeat;
  import_x_scales(in, x_scales, x_token_scales, x_rows);
  import_routing(in, topk_idx, topk_weights, cached, x_rows, x_repeat);
  FERRY_CHECK_INPUT(num_tokens <= max_tokens_, "num_tokens=", num_tokens,
                    x_repeat == 1 ? " (rows of x)" : " (rows of x times x_repeat)", " is outside [0, ",
                    "max_tokens_per_rank=", max_tokens_, "]; split the batch or raise max_tokens_per_rank");
  in.args.x = xa.data();
  in.args.x_repeat = x_repeat;
  in.args.num_tokens = static_cast<int>(num_tokens);
  in.args.expand = expand;
  in.args.eager = eager;
  in.args.return_recv_hook = return_recv_hook;
  in.stream = resolve_stream(stream, in.framework);
  return in;
}

// x: bf16 rows [num_tokens, hidden], or (prequantized) the payload of a quantized dispatch_format, fp8 or fp4.
ArrayArg PyEpBuffer::import_x(Inputs& in, nb::handle x, bool prequantized) const {
  ArrayArg xa;
  if (!prequantized) {
    xa = placement_.import(x, "x", {-1, hidden_}, "num_tokens");
    check_dtype(xa.dtype(), "x", {kBf16, kU16}, "bfloat16 (or uint16 holding bf16 bits)");
    return xa;
  }
  bool const fp8 = format_ == WireFormat::fp8_e4m3 || format_ == WireFormat::fp8_e4m3_ue8m0;
  Frameworks const& f = frameworks();
  in.x_bytes = torch_bytes(x, in.framework, fp8 ? f.torch_fp8_e4m3fn : f.torch_fp4_e2m1fn_x2);
  xa = placement_.import(in.x_bytes, "x", {-1, static_cast<int64_t>(wire_.payload_bytes)}, "num_tokens");
  if (fp8)
    check_dtype(xa.dtype(), "x", {kFp8, kU8, kI8},
                "float8_e4m3fn or uint8 (pre-quantized x is the fp8 payload: one byte per element)");
  else
    check_dtype(xa.dtype(), "x", {kU8, kI8},
                "uint8 (pre-quantized x is the e2m1 payload: two elements per byte, element 2i in the low nibble)");
  return xa;
}

void PyEpBuffer::import_x_scales(Inputs& in, nb::handle x_scales, nb::handle x_token_scales, int64_t x_rows) const {
  bool const prequantized = !x_scales.is_none() && format_ != WireFormat::bf16;
  if (!x_scales.is_none()) {
    if (prequantized) {
      Frameworks const& f = frameworks();
      in.scales_bytes = torch_bytes(x_scales, in.framework,
                                    format_ == WireFormat::nvfp4 ? f.torch_fp8_e4m3fn
                                    : wire_.scale_bytes == 1     ? f.torch_fp8_e8m0fnu
                                                                 : nb::none());
      auto const sa = placement_.import(in.scales_bytes, "x_scales", {x_rows, wire_.num_scales}, "");
      if (wire_.scale_bytes == 4)
        check_dtype(sa.dtype(), "x_scales", {kF32}, "float32 (the fp32 block scales of dispatch_format=fp8)");
      else if (format_ == WireFormat::nvfp4)
        check_dtype(sa.dtype(), "x_scales", {kU8, kFp8}, "uint8 or float8_e4m3fn (nvfp4's e4m3 block scales)");
      else
        check_dtype(sa.dtype(), "x_scales", {kU8, kE8M0}, "uint8 or float8_e8m0fnu (UE8M0 block scales)");
      in.args.x_scales = nonnull(sa.data());
    } else {
      in.args.x_scales = nonnull(placement_.import_any(x_scales, "x_scales").data());
    }
  }
  if (!x_token_scales.is_none()) {
    if (prequantized && wire_.has_token_scale) {
      auto const ta = placement_.import(x_token_scales, "x_token_scales", {x_rows}, "");
      check_dtype(ta.dtype(), "x_token_scales", {kF32}, "float32 (nvfp4's per-token scales)");
      in.args.x_token_scales = static_cast<float const*>(nonnull(ta.data()));
    } else {
      in.args.x_token_scales =
          static_cast<float const*>(nonnull(placement_.import_any(x_token_scales, "x_token_scales").data()));
    }
  }
}

void PyEpBuffer::import_routing(Inputs& in, nb::handle topk_idx, nb::handle topk_weights, bool cached, int64_t x_rows,
                                int x_repeat) const {
  if (cached) {
    if (!topk_idx.is_none()) in.args.topk_idx = nonnull(placement_.import_any(topk_idx, "topk_idx").data());
    if (!topk_weights.is_none())
      in.args.topk_weights =
          static_cast<float const*>(nonnull(placement_.import_any(topk_weights, "topk_weights").data()));
    return;
  }
  FERRY_CHECK_INPUT(!topk_idx.is_none(), "topk_idx is None; dispatch needs the [num_tokens, topk] expert ids ",
                    "(only a cached dispatch, handle=h, routes without them)");
  FERRY_CHECK_INPUT(!topk_weights.is_none(), "topk_weights is None; dispatch needs the [num_tokens, topk] ",
                    "weights (only a cached dispatch, handle=h, routes without them)");
  int64_t const num_tokens = x_rows * x_repeat;
  // entry tokens (x_repeat=r on a topk-1 buffer): the ids and weights may come as [rows of x, r], each token's r
  // entries in a row, the same memory as [num_tokens, 1]
  auto const import_entries = [&](nb::handle array, char const* name) {
    if (x_repeat > 1 && topk_ == 1) {
      ArrayArg a = placement_.import_any(array, name);
      if (a.ndim() == 2 && static_cast<int64_t>(a.shape(0)) == x_rows && static_cast<int64_t>(a.shape(1)) == x_repeat) {
        FERRY_CHECK_INPUT(is_c_contiguous(a), name, " of shape ", shape_text(a),
                          " is not contiguous (row-major); pass a contiguous array (.contiguous() / "
                          "np.ascontiguousarray)");
        return a;
      }
    }
    return placement_.import(array, name, {num_tokens, topk_}, "num_tokens");
  };
  auto const idx = import_entries(topk_idx, "topk_idx");
  check_dtype(idx.dtype(), "topk_idx", {kI32, kI64}, "int32 or int64");
  auto const weights = import_entries(topk_weights, "topk_weights");
  check_dtype(weights.dtype(), "topk_weights", {kF32}, "float32");
  in.args.topk_idx = idx.data();
  in.args.topk_idx_type = idx.dtype() == kI32 ? IndexType::int32 : IndexType::int64;
  in.args.topk_weights = static_cast<float const*>(weights.data());
}

ResultObject PyEpBuffer::dispatch(nb::handle x, nb::handle topk_idx, nb::handle topk_weights, nb::handle x_scales,
                                  nb::handle x_token_scales, bool expand, bool eager, bool return_recv_hook,
                                  nb::handle save_handle, nb::handle handle, nb::handle stream, int x_repeat) {
  PyDispatchHandle* save = nullptr;
  Inputs in = checked(Leg::dispatch, stream, x, [&] {
    save = handle_arg(save_handle, "save_handle");
    return dispatch_inputs_with(x, topk_idx, topk_weights, x_scales, x_token_scales, expand, eager, stream,
                                return_recv_hook, save, handle_arg(handle, "handle"), x_repeat);
  });
  DispatchResult const got = run_dispatch(in, save);
  return result_object(result(got, in.framework, eager && !return_recv_hook));
}

// A normal-mode dispatch whose rank-major outputs are fresh arrays the caller owns (what a caller that keeps them
// past the next dispatch needs, ferry.deep_ep among them: DeepEP returns new tensors), filled here in one launch
// instead of by framework ops in Python: (recv_x, recv_scales or None, recv_topk_idx, recv_topk_weights, expert
// counts as a list (eager) or None, the DispatchHandle saved into (save_handle=True) or None, num_recv). Rows:
// num_recv_host (eager) or recv_capacity (lazy; rows at or past num_recv unspecified, their ids included).
// recv_topk_idx has topk_idx's dtype (int64 or int32); with handle= (a cached dispatch) the ids, weights and counts
// are None. Refusals as dispatch().
nb::tuple PyEpBuffer::dispatch_owned(nb::handle x, nb::handle topk_idx, nb::handle topk_weights, nb::handle x_scales,
                                     bool eager, bool save_handle, nb::handle handle, nb::handle stream,
                                     bool with_src) {
  nb::object saved = nb::none();
  nb::object device;  // x's torch.device: the outputs' and the handle's
  PyDispatchHandle* save = nullptr;
  PyDispatchHandle* cached = nullptr;
  Inputs in = checked(Leg::dispatch, stream, x, [&] {
    cached = handle_arg(handle, "handle");
    FERRY_CHECK_INPUT(cached == nullptr || !save_handle,
                      "a cached dispatch (handle=) saves no handle; pass save_handle=False");
    FERRY_CHECK_INPUT(framework_of(x) == kTorch, "x must be a torch tensor (this call returns torch tensors), got ",
                      python_type_name(x));
    device = x.attr("device");
    if (save_handle) {
      saved = nb::cast(make_handle(device));
      save = nb::inst_ptr<PyDispatchHandle>(saved);
    }
    return dispatch_inputs_with(x, topk_idx, topk_weights, x_scales, nb::none(), false, eager, stream, false, save,
                                cached);
  });
  // eager: the counts come back within the dispatch's one synchronisation
  std::vector<int32_t> counts_host;
  if (eager && !cached) {
    counts_host.resize(static_cast<std::size_t>(num_local_));
    in.args.expert_counts_host = counts_host.data();
  }
  DispatchResult const got = run_dispatch(in, save);
  int64_t const rows = eager && got.num_recv_host >= 0 ? got.num_recv_host : capacity_;
  OwnedOutputs out = owned_outputs(device, rows, cached == nullptr, in.args.topk_idx_type, with_src);
  nb::object counts = nb::none();
  if (eager && !cached) {
    nb::list list;
    for (int32_t c : counts_host) list.append(c);
    counts = std::move(list);
  }
  {
    Exclusive const exclusive(*this);
    nb::gil_scoped_release release;
    buffer_->copy_received(out.to, in.stream);
  }
  nb::object const num_recv = view(views_[kTorch].num_recv, got.num_recv, kTorch, ViewSpec(kI32, {1}));
  return nb::make_tuple(out.recv_x, out.recv_scales, out.ids, out.weights, counts, saved, num_recv, out.src);
}

// Fresh tensors of `rows` rows from torch's allocator (on the current stream) for copy_received to fill in one copy
// (one kernel on cuda): recv_x, row-major recv_scales (quantized delivery), and with routing the ids (of idx_type)
// and weights; None where not made.
PyEpBuffer::OwnedOutputs PyEpBuffer::owned_outputs(nb::handle device, int64_t rows, bool routing, IndexType idx_type,
                                                   bool with_src) const {
  Owned const owned(nb::borrow(device));
  OwnedOutputs out;
  out.to.rows = static_cast<int>(rows);
  out.recv_x = owned.empty(rows, static_cast<int64_t>(recv_x_spec_.dims[1]), recv_x_spec_.dtype);
  out.to.recv_x = Owned::data_of(out.recv_x);
  out.recv_scales = out.ids = out.weights = out.src = nb::none();
  if (with_src) {
    out.src = owned.empty(rows, 2, kI32);
    out.to.recv_src = static_cast<int32_t*>(Owned::data_of(out.src));
  }
  if (quantized_) {
    FERRY_CHECK_INPUT(scale_layout_ == ScaleLayout::row_major, "this call returns row-major recv_scales only");
    out.recv_scales = owned.empty(rows, wire_.num_scales, wire_.scale_bytes == 4 ? kF32 : kU8);
    out.to.recv_scales = Owned::data_of(out.recv_scales);
  }
  if (routing) {
    out.weights = owned.empty(rows, topk_, kF32);
    out.to.recv_topk_weights = static_cast<float*>(Owned::data_of(out.weights));
    out.ids = owned.empty(rows, topk_, idx_type == IndexType::int64 ? kI64 : kI32);
    out.to.recv_topk_idx = Owned::data_of(out.ids);
    out.to.recv_topk_idx_type = idx_type;
  }
  return out;
}

// dispatch_inputs with the handles set: save (save_handle=) and cached (handle=: a cached dispatch).
PyEpBuffer::Inputs PyEpBuffer::dispatch_inputs_with(nb::handle x, nb::handle topk_idx, nb::handle topk_weights,
                                                    nb::handle x_scales, nb::handle x_token_scales, bool expand,
                                                    bool eager, nb::handle stream, bool return_recv_hook,
                                                    PyDispatchHandle* save, PyDispatchHandle* cached,
                                                    int x_repeat) const {
  Inputs got = dispatch_inputs(x, topk_idx, topk_weights, x_scales, x_token_scales, expand, eager, stream,
                               return_recv_hook, cached != nullptr, x_repeat);
  if (save) got.args.save_handle = &save->handle;
  if (cached) got.args.handle = &cached->handle;
  return got;
}

// The C++ dispatch of checked inputs; save: the handle it saves into (its num_recv_host is set here).
DispatchResult PyEpBuffer::run_dispatch(Inputs const& in, PyDispatchHandle* save) {
  DispatchResult got;
  {
    Exclusive const exclusive(*this);
    // NOTE: forgotten before the call and remembered only once it returned: a dispatch that raises (refused, or
    // failed after it completed: rows dropped in eager mode) leaves C++ with no dispatch to combine, and a combine
    // sized for the dispatch before would let C++ write past out's end (SIGSEGV before).
    forget_dispatch();
    nb::gil_scoped_release release;
    got = buffer_->dispatch(in.args, in.stream);
  }
  remember_dispatch(in.args.num_tokens, got, in.framework, in.args.eager);
  if (save) save->num_recv_host = got.num_recv_host;
  return got;
}

// The receive half of a dispatch made with return_recv_hook (low-latency mode).
// NOTE: the completions refuse a bad stream locally, before anything: the hook stays pending (the send half already
// went out, so there is no exchange left to join as a refusal), and a second call with a good stream completes it.
// The C++ completions refuse their misuse the same way.
ResultObject PyEpBuffer::complete_dispatch(nb::handle stream) {
  cudaStream_t const s = resolve_stream(stream, last_framework_);
  bool const hooked = buffer_->pending_hook() == std::string("dispatch");  // else C++ refuses, nothing changes
  DispatchResult got;
  {
    Exclusive const exclusive(*this);
    if (hooked) forget_dispatch();
    nb::gil_scoped_release release;
    got = buffer_->complete_dispatch(s);
  }
  remember_dispatch(hooked_num_tokens_, got, last_framework_, last_eager_);
  return result_object(result(got, last_framework_, last_eager_));
}

void PyEpBuffer::complete_combine(nb::handle stream) {
  cudaStream_t const s = resolve_stream(stream, last_framework_);
  Exclusive const exclusive(*this);
  nb::gil_scoped_release release;
  buffer_->complete_combine(s);
}

// ---- combine --------------------------------------------------------------------------------------------------------

// Converts and checks combine arguments (no C++ call) for a dispatch of num_tokens tokens (y's rows).
// num_recv_host: the rows that dispatch received, when known on the host (-1: not known, recv_capacity is read).
// group, group_weights (mode='ll', topk 1): y gets num_tokens / group rows, the weighted sums of groups of tokens
// (CombineArgs::group); group_weights [num_tokens / group, group] float32.
PyEpBuffer::CombineInputs PyEpBuffer::combine_inputs(nb::handle x, std::string const& layout, nb::handle out,
                                                     bool eager, nb::handle stream, int num_tokens,
                                                     int64_t num_recv_host, bool return_recv_hook, int group,
                                                     nb::handle group_weights) const {
  CombineInputs in;
  bool const expert_major = layout == "expert";
  FERRY_CHECK_INPUT(expert_major || layout == "rank", "layout='", layout,
                    "' is not a combine layout; use 'expert' (expert outputs [num_local_experts, expert_capacity, ",
                    "hidden], weights applied by combine) or 'rank' (rows [num_recv, hidden], already reduced)");
  ArrayArg xa;
  if (expert_major) {
    FERRY_CHECK_INPUT(slots_ > 0, "combine layout='expert' needs an expert-major layout: create the EpBuffer with ",
                      "expert_capacity and dispatch with expand=True, or combine with layout='rank'");
    xa = placement_.import(x, "x", {num_local_, slots_, hidden_}, "");
  } else {
    xa = placement_.import(x, "x", {-1, hidden_}, "rows");
    // Rows the C++ side reads: num_recv (known on the host after an eager dispatch), else up to the capacity.
    int64_t const needed = num_recv_host >= 0 ? num_recv_host : capacity_;
    FERRY_CHECK_INPUT(static_cast<int64_t>(xa.shape(0)) >= needed, "x has ", xa.shape(0), " rows; combine ",
                      "layout='rank' reads ", needed,
                      num_recv_host >= 0 ? " (num_recv of the dispatch it combines)" : " (recv_capacity)",
                      " rows of [rows, hidden=", hidden_, "]");
  }
  check_dtype(xa.dtype(), "x", {kBf16, kU16}, "bfloat16 (or uint16 holding bf16 bits)");
  Framework const framework = framework_of(x);
  // a group that does not divide the tokens: y as if ungrouped, and the C++ call refuses the group
  int const y_rows = group >= 1 && num_tokens >= 0 && num_tokens % group == 0 ? num_tokens / group : num_tokens;
  if (!group_weights.is_none()) {
    // shape and dtype checked against a group that divides the tokens (else the C++ call refuses the group)
    auto const wa = y_rows == num_tokens && group != 1
                        ? placement_.import_any(group_weights, "group_weights")
                        : placement_.import(group_weights, "group_weights", {y_rows, group}, "");
    check_dtype(wa.dtype(), "group_weights", {kF32}, "float32");
    in.args.group_weights = static_cast<float const*>(nonnull(wa.data()));
  }
  in.args.group = group;
  if (num_tokens >= 0) {
    in.y = out.is_none() ? allocate_rows(framework, x, y_rows, false, "combine") : nb::borrow(out);
    auto const ya = placement_.import(in.y, "out", {y_rows, hidden_}, "", Placement::Access::write);
    check_dtype(ya.dtype(), "out", {kBf16, kU16}, "bfloat16 (or uint16 holding bf16 bits)");
    in.args.y = ya.data();
  }
  // else: no dispatch to combine (none yet, or the last one raised); the C++ call refuses with its own message
  in.args.layout = expert_major ? CombineLayout::expert_major : CombineLayout::rank_major;
  in.args.x = xa.data();
  in.args.eager = eager;
  in.args.return_recv_hook = return_recv_hook;
  in.stream = resolve_stream(stream, framework);
  return in;
}

nb::object PyEpBuffer::combine(nb::handle x, std::string const& layout, nb::handle out, bool eager,
                               bool return_recv_hook, nb::handle handle, nb::handle stream, int group,
                               nb::handle group_weights) {
  PyDispatchHandle* h = nullptr;
  CombineInputs in = checked(Leg::combine, stream, x, [&] {
    h = handle_arg(handle, "handle");
    // a handle's dispatch: its tokens (0 before a save: the C++ call refuses the handle itself)
    CombineInputs got = h ? combine_inputs(x, layout, out, eager, stream, h->handle.num_tokens(), h->num_recv_host,
                                           return_recv_hook, group, group_weights)
                          : combine_inputs(x, layout, out, eager, stream, last_num_tokens_, last_num_recv_host_,
                                           return_recv_hook, group, group_weights);
    if (h) got.args.handle = &h->handle;
    return got;
  });
  {
    Exclusive const exclusive(*this);
    nb::gil_scoped_release release;
    buffer_->combine(in.args, in.stream);
  }
  if (h) use_handle(*h);
  return in.y.is_valid() ? in.y : nb::none();
}

// ---- handles and the backward passes --------------------------------------------------------------------------------

// A handle for this buffer's layout shape (EpBuffer::make_handle). cuda: its storage is a torch uint8 tensor on this
// GPU when torch is loaded (the caching allocator, allocated on the current torch stream), else the library's own
// device memory; cpu: host memory of the handle's own.
// device: a torch.device of this GPU where the caller has one at hand (a string is parsed per call otherwise)
PyDispatchHandle PyEpBuffer::make_handle(nb::handle device) const {
  PyDispatchHandle out;
  std::size_t const bytes = buffer_->handle_bytes();
  if (bytes > 0 && torch_tensor_type() != nullptr) {
    Frameworks const& f = frameworks();
    nb::object const on =
        device.is_valid() ? nb::borrow(device) : nb::str(concat("cuda:", placement_.device()).c_str());
    out.storage = f.torch_empty(nb::make_tuple(bytes), "dtype"_a = f.torch_uint8, "device"_a = on);
    auto const storage =
        placement_.import(out.storage, "handle storage", {static_cast<int64_t>(bytes)}, "", Placement::Access::write);
    out.handle = buffer_->make_handle(storage.data(), bytes);
  } else {
    out.storage = nb::none();
    out.handle = buffer_->make_handle();
  }
  return out;
}

// The count matrix of the handle's dispatch (EpBuffer::copy_rank_counts) as an int32 [world, world] array: into out
// when given, else a new one (a torch tensor on this buffer's device when torch is loaded, else NumPy).
nb::object PyEpBuffer::rank_counts(nb::handle handle, nb::handle out, nb::handle stream) {
  PyDispatchHandle* const h = required_handle(handle, "rank_counts");
  int64_t const world = buffer_->communicator().world();
  nb::object result;
  if (!out.is_none()) {
    result = nb::borrow(out);
  } else if (torch_tensor_type() != nullptr) {
    Frameworks const& f = frameworks();
    nb::object const on =
        placement_.backend() == Backend::cuda ? nb::str(concat("cuda:", placement_.device()).c_str()) : nb::str("cpu");
    result = f.torch_empty(nb::make_tuple(world, world), "dtype"_a = f.torch_int32, "device"_a = on);
  } else {
    numpy_ndarray_type();
    result = frameworks().numpy_empty(nb::make_tuple(world, world), "dtype"_a = "int32");
  }
  ArrayArg const a = placement_.import(result, "out", {world, world}, "", Placement::Access::write);
  check_dtype(a.dtype(), "out", {kI32}, "int32");
  cudaStream_t const s = resolve_stream(stream, framework_of(result));
  nb::gil_scoped_release release;
  buffer_->copy_rank_counts(h->handle, static_cast<int32_t*>(a.data()), s);
  return result;
}

// After a call that made the handle's layout the buffer's current one (EpBuffer: combine with a handle and the
// backward passes): a later combine without a handle refers to that dispatch.
void PyEpBuffer::use_handle(PyDispatchHandle const& handle) {
  last_num_tokens_ = handle.handle.num_tokens();
  last_num_recv_host_ = handle.num_recv_host;
}

// The backward pass of a dispatch (EpBuffer::dispatch_backward): grad of the rows it delivered (layout 'rank':
// recv_x [>= num_recv, hidden]; 'expert': expert_x) -> grad_x [num_tokens, hidden] (bf16, or fp32 with fp32).
nb::object PyEpBuffer::dispatch_backward(nb::handle grad, nb::handle handle, std::string const& layout, nb::handle out,
                                         bool fp32, bool eager, nb::handle stream) {
  struct BackwardInputs {
    DispatchBackwardArgs args;
    cudaStream_t stream = nullptr;
    nb::object grad_x;
    PyDispatchHandle* handle = nullptr;
  };
  BackwardInputs in = checked(Leg::combine, stream, grad, [&] {
    BackwardInputs got;
    got.handle = required_handle(handle, "dispatch_backward");
    bool const expert_major = expert_layout(layout, "dispatch_backward");
    ArrayArg const ga = grad_rows(grad, "grad", expert_major, got.handle->num_recv_host, "dispatch_backward");
    Framework const framework = framework_of(grad);
    int const num_tokens = got.handle->handle.num_tokens();
    got.grad_x =
        out.is_none() ? allocate_rows(framework, grad, num_tokens, fp32, "dispatch_backward") : nb::borrow(out);
    auto const oa = placement_.import(got.grad_x, "out", {num_tokens, hidden_}, "", Placement::Access::write);
    if (fp32)
      check_dtype(oa.dtype(), "out", {kF32}, "float32 (fp32=True)");
    else
      check_dtype(oa.dtype(), "out", {kBf16, kU16}, "bfloat16 (or uint16 holding bf16 bits; fp32=True for float32)");
    got.args.handle = &got.handle->handle;
    got.args.layout = expert_major ? CombineLayout::expert_major : CombineLayout::rank_major;
    got.args.grad = ga.data();
    got.args.grad_x = oa.data();
    got.args.grad_x_fp32 = fp32;
    got.args.eager = eager;
    got.stream = resolve_stream(stream, framework);
    return got;
  });
  {
    Exclusive const exclusive(*this);
    nb::gil_scoped_release release;
    buffer_->dispatch_backward(in.args, in.stream);
  }
  use_handle(*in.handle);
  return in.grad_x;
}

struct PyEpBuffer::CombineBackwardInputs {
  CombineBackwardArgs args;
  cudaStream_t stream = nullptr;
  nb::object grad_w;
  Framework framework = kNumpy;
  int num_tokens = 0;
};

// The backward pass of a combine (EpBuffer::combine_backward): a cached dispatch of grad_y [num_tokens, hidden].
// Returns (the gradient rows: recv_x for layout 'rank', expert_x for 'expert', views of this buffer valid until its
// next dispatch; grad_topk_weights [num_tokens, topk] float32 or None).
nb::tuple PyEpBuffer::combine_backward(nb::handle grad_y, nb::handle handle, std::string const& layout, nb::handle x,
                                       std::optional<bool> want_grad_weights, nb::handle grad_topk_weights, bool eager,
                                       nb::handle stream) {
  // NOTE: an unreadable layout is refused as the default one ('expert'): which exchanges a refusal joins depends on
  // the layout (EpBuffer::refuse_combine_backward), and the peers' calls are meant to be the same call.
  bool const expert_major = layout != "rank";
  CombineBackwardInputs in;
  std::string reason;
  try {
    PyDispatchHandle* const h = required_handle(handle, "combine_backward");
    expert_layout(layout, "combine_backward");
    in = combine_backward_inputs(grad_y, h, expert_major, x, want_grad_weights, grad_topk_weights, eager, stream);
  } catch (InputError const& error) {
    reason = error.what();
  }
  if (!reason.empty()) {
    cudaStream_t const s = refusal_stream(stream, grad_y);
    Exclusive const exclusive(*this);
    forget_dispatch();
    nb::gil_scoped_release release;
    buffer_->refuse_combine_backward(expert_major ? CombineLayout::expert_major : CombineLayout::rank_major, reason, s);
  }
  DispatchResult got;
  {
    Exclusive const exclusive(*this);
    forget_dispatch();  // as in dispatch: remembered once it returned
    nb::gil_scoped_release release;
    got = buffer_->combine_backward(in.args, in.stream);
  }
  remember_dispatch(in.num_tokens, got, in.framework, eager);
  PyDispatchResult const views = result(got, in.framework, eager);
  return nb::make_tuple(expert_major ? views.expert_x : views.recv_x, in.grad_w.is_valid() ? in.grad_w : nb::none());
}

// Converts and checks combine_backward's arguments for the dispatch that saved h (no C++ call).
PyEpBuffer::CombineBackwardInputs PyEpBuffer::combine_backward_inputs(nb::handle grad_y, PyDispatchHandle* h,
                                                                      bool expert_major, nb::handle x,
                                                                      std::optional<bool> want_grad_weights,
                                                                      nb::handle grad_topk_weights, bool eager,
                                                                      nb::handle stream) const {
  CombineBackwardInputs in;
  in.num_tokens = h->handle.num_tokens();
  in.framework = framework_of(grad_y);
  auto const ga = placement_.import(grad_y, "grad_y", {in.num_tokens, hidden_}, "");
  check_dtype(ga.dtype(), "grad_y", {kBf16, kU16}, "bfloat16 (or uint16 holding bf16 bits)");
  bool const want = want_grad_weights.value_or(expert_major);
  if (expert_major) {
    FERRY_CHECK_INPUT(slots_ > 0, "combine_backward layout='expert' needs an expert-major layout: create the ",
                      "EpBuffer with expert_capacity");
    FERRY_CHECK_INPUT(!want || !x.is_none(), "combine_backward layout='expert' computes grad_topk_weights from ",
                      "x, the forward combine's expert outputs [", num_local_, ", ", slots_, ", ", hidden_,
                      "]; pass x, or want_grad_weights=False");
    if (!x.is_none()) {
      auto const xa = placement_.import(x, "x", {num_local_, slots_, hidden_}, "");
      check_dtype(xa.dtype(), "x", {kBf16, kU16}, "bfloat16 (or uint16 holding bf16 bits)");
      in.args.x = xa.data();
    }
  } else {
    FERRY_CHECK_INPUT(!want, "combine_backward layout='rank' has no weights to differentiate (the caller ",
                      "applied them); pass want_grad_weights=False (or leave it None)");
    if (!x.is_none()) in.args.x = nonnull(placement_.import_any(x, "x").data());
  }
  if (want) {
    in.grad_w = grad_topk_weights.is_none()
                    ? allocate(in.framework, grad_y, in.num_tokens, topk_, true, "combine_backward")
                    : nb::borrow(grad_topk_weights);
    auto const wa =
        placement_.import(in.grad_w, "grad_topk_weights", {in.num_tokens, topk_}, "", Placement::Access::write);
    check_dtype(wa.dtype(), "grad_topk_weights", {kF32}, "float32");
    in.args.grad_topk_weights = static_cast<float*>(wa.data());
  } else {
    FERRY_CHECK_INPUT(grad_topk_weights.is_none(), "grad_topk_weights is given but want_grad_weights=False");
  }
  in.args.handle = &h->handle;
  in.args.layout = expert_major ? CombineLayout::expert_major : CombineLayout::rank_major;
  in.args.grad_y = ga.data();
  in.args.eager = eager;
  in.stream = resolve_stream(stream, in.framework);
  return in;
}

// Gradient rows in a dispatch's layout: expert-major [num_local_experts, expert_capacity, hidden], or rank-major
// [>= num_recv, hidden] (num_recv_host < 0: recv_capacity rows), bf16.
ArrayArg PyEpBuffer::grad_rows(nb::handle grad, char const* name, bool expert_major, int64_t num_recv_host,
                               char const* call) const {
  ArrayArg ga;
  if (expert_major) {
    FERRY_CHECK_INPUT(slots_ > 0, call, " layout='expert' needs an expert-major layout: create the EpBuffer with ",
                      "expert_capacity");
    ga = placement_.import(grad, name, {num_local_, slots_, hidden_}, "");
  } else {
    ga = placement_.import(grad, name, {-1, hidden_}, "rows");
    int64_t const needed = num_recv_host >= 0 ? num_recv_host : capacity_;
    FERRY_CHECK_INPUT(static_cast<int64_t>(ga.shape(0)) >= needed, name, " has ", ga.shape(0), " rows; ", call,
                      " layout='rank' reads ", needed,
                      num_recv_host >= 0 ? " (num_recv of the handle's dispatch)" : " (recv_capacity)",
                      " rows of [rows, hidden=", hidden_, "]");
  }
  check_dtype(ga.dtype(), name, {kBf16, kU16}, "bfloat16 (or uint16 holding bf16 bits)");
  return ga;
}

// Host seconds of `iters` dispatch + combine pairs run in a C++ loop (arguments converted once): what the same calls
// cost without Python, for bench_overhead.py.
double PyEpBuffer::time_cpp_loop(int iters, nb::handle x, nb::handle topk_idx, nb::handle topk_weights, bool expand,
                                 nb::handle combine_x, std::string const& layout, nb::handle out, bool eager,
                                 nb::handle stream) {
  FERRY_CHECK_INPUT(iters >= 1, "iters=", iters, " must be at least 1");
  Inputs const d = dispatch_inputs(x, topk_idx, topk_weights, nb::none(), nb::none(), expand, eager, stream);
  CombineInputs const c = combine_inputs(combine_x, layout, out, eager, stream, d.args.num_tokens, last_num_recv_host_);
  Exclusive const exclusive(*this);
  nb::gil_scoped_release release;
  auto const start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) {
    forget_dispatch();  // as in dispatch: remembered once it returned
    remember_dispatch(d.args.num_tokens, buffer_->dispatch(d.args, d.stream), d.framework, eager);
    buffer_->combine(c.args, c.stream);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// ---- refusals, streams, outputs -------------------------------------------------------------------------------------

// Runs the binding's own argument checks of a call (they return what the C++ call needs). An InputError they raise
// is this rank's refusal of the call: it joins the call's exchange as a refusal (EpBuffer::refuse_*: every peer's
// same call fails with InputError naming this rank, so the ranks stay in step) and raises the same message here.
// stream / like: the call's stream argument and an input whose framework picks the default stream.
template <typename Checks>
auto PyEpBuffer::checked(Leg leg, nb::handle stream, nb::handle like, Checks&& checks) -> decltype(checks()) {
  std::string reason;
  try {
    return checks();
  } catch (InputError const& error) {
    reason = error.what();
  }
  cudaStream_t const s = refusal_stream(stream, like);
  Exclusive const exclusive(*this);
  if (leg == Leg::dispatch) forget_dispatch();
  nb::gil_scoped_release release;
  if (leg == Leg::dispatch) buffer_->refuse_dispatch(reason, s);
  buffer_->refuse_combine(reason, s);
}

// The stream a refused call would have used: its stream argument, else (that argument being what is refused) the
// default for like's framework; null on the cpu backend.
cudaStream_t PyEpBuffer::refusal_stream(nb::handle stream, nb::handle like) const {
  if (placement_.backend() == Backend::cpu) return nullptr;
  Framework const framework = framework_of(like);
  for (nb::handle given : {stream, nb::handle(Py_None)}) {
    try {
      return resolve_stream(given, framework);
    } catch (std::exception const&) {
      continue;  // a stream argument that cannot be read: the default one
    }
  }
  return nullptr;
}

// What combine refers to, as C++ holds it (EpBuffer: the last dispatch that succeeded on this rank): the tokens of the
// last dispatch that returned (y's rows), or, after one that raised, none (the C++ combine then refuses).
void PyEpBuffer::remember_dispatch(int num_tokens, DispatchResult const& got, Framework framework, bool eager) {
  bool const hooked = buffer_->pending_hook() == std::string("dispatch");
  hooked_num_tokens_ = hooked ? num_tokens : -1;
  last_num_tokens_ = hooked ? -1 : num_tokens;  // combined after its completion (C++ refuses a combine before)
  last_num_recv_host_ = got.num_recv_host;
  last_framework_ = framework;
  last_eager_ = eager;
}

void PyEpBuffer::forget_dispatch() {
  last_num_tokens_ = -1;
  last_num_recv_host_ = -1;
}

cudaStream_t PyEpBuffer::resolve_stream(nb::handle stream, Framework framework) const {
  if (!stream.is_none()) return stream_from(stream);
  // Default: the current torch stream of this GPU for torch CUDA tensors; else the default stream (null).
  if (placement_.backend() == Backend::cuda && framework == kTorch) return torch_current_stream(placement_.device());
  return nullptr;
}

// An output [rows, cols] in like's framework and device: bf16 (NumPy: uint16 bits) or float32.
nb::object PyEpBuffer::allocate(Framework framework, nb::handle like, int64_t rows, int64_t cols, bool fp32,
                                char const* call) const {
  nb::tuple const shape = nb::make_tuple(rows, cols);
  if (framework == kTorch) {
    Frameworks const& f = frameworks();
    nb::object const dtype = fp32 ? f.torch_f32 : f.torch_bf16;
    return f.torch_empty(shape, "dtype"_a = dtype, "device"_a = like.attr("device"));
  }
  FERRY_CHECK_INPUT(placement_.backend() == Backend::cpu, call, " cannot allocate its output for a ",
                    python_type_name(like), " on the cuda backend; pass out=[", rows, ", ", cols, "] ",
                    fp32 ? "float32" : "bfloat16", " on cuda:", placement_.device());
  numpy_ndarray_type();
  return frameworks().numpy_empty(shape, "dtype"_a = fp32 ? "float32" : "uint16");
}

nb::object PyEpBuffer::allocate_rows(Framework framework, nb::handle like, int64_t rows, bool fp32,
                                     char const* call) const {
  return allocate(framework, like, rows, hidden_, fp32, call);
}

// ---- cached views ---------------------------------------------------------------------------------------------------

// Delivered rows (recv_x, expert_x: `groups` > 0 adds a leading dimension): bf16 [rows, hidden], or the quantized
// payload, fp8 [rows, hidden] (float8_e4m3fn) or fp4 [rows, hidden / 2] (uint8, two elements per byte).
PyEpBuffer::ViewSpec PyEpBuffer::row_spec(size_t groups, size_t rows, size_t row_bytes) const {
  nb::dlpack::dtype const dtype = !quantized_                                           ? kBf16
                                  : wire_.payload_bytes == static_cast<size_t>(hidden_) ? kFp8
                                                                                        : kU8;
  size_t const cols = quantized_ ? row_bytes : static_cast<size_t>(hidden_);
  return groups ? ViewSpec(dtype, {groups, rows, cols}) : ViewSpec(dtype, {rows, cols});
}

// One scale tensor of `rows` rows in recv_scale_layout (`groups` > 0: that many back to back, a leading dimension),
// its shape read off scale_tensor_bytes: row_major [rows, num_scales]; mn_major_tma [num_scales, rows_aligned];
// mn_major_tma_packed_ue8m0 int32 [ceil(num_scales / 4), rows_aligned]; blocked_128x4 uint8 [bytes]. Elements are
// float32 (fp8's scales) or one byte (uint8).
PyEpBuffer::ViewSpec PyEpBuffer::scale_spec(size_t groups, int rows) const {
  size_t const bytes = scale_tensor_bytes(format_, scale_layout_, rows, hidden_);
  size_t const num_scales = static_cast<size_t>(wire_.num_scales);
  size_t const elem = static_cast<size_t>(wire_.scale_bytes);
  nb::dlpack::dtype const dtype = elem == 4 ? kF32 : kU8;
  ViewSpec spec;
  switch (scale_layout_) {
    case ScaleLayout::row_major:
      spec = ViewSpec(dtype, {static_cast<size_t>(rows), num_scales});
      break;
    case ScaleLayout::mn_major_tma:
      spec = ViewSpec(dtype, {num_scales, bytes / (num_scales * elem)});
      break;
    case ScaleLayout::mn_major_tma_packed_ue8m0: {
      size_t const words = (num_scales + 3) / 4;
      spec = ViewSpec(kI32, {words, bytes / (words * 4)});
      break;
    }
    case ScaleLayout::blocked_128x4:
      spec = ViewSpec(kU8, {bytes});
      break;
  }
  if (groups) {
    std::copy_backward(spec.dims, spec.dims + spec.ndim, spec.dims + spec.ndim + 1);
    spec.dims[0] = groups;
    ++spec.ndim;
  }
  return spec;
}

nb::object PyEpBuffer::view(View& slot, void const* data, Framework framework, ViewSpec const& spec) {
  if (data == nullptr) return nb::none();
  if (slot.data != data || !slot.object.is_valid()) {
    nb::dlpack::dtype dtype = spec.dtype;
    if (framework == kNumpy && dtype == kBf16) dtype = kU16;  // NOTE: NumPy has no bfloat16: raw bits
    // NOTE: NumPy has no fp8 (raw bytes); torch gets uint8 made float8_e4m3fn by Tensor.view, which works whether or
    // not its DLPack knows fp8. Other DLPack consumers get DLPack's float8_e4m3fn.
    bool const torch_fp8 = framework == kTorch && dtype == kFp8;
    if (dtype == kFp8 && framework != kDlpack) dtype = kU8;
    int const type = placement_.dlpack_device_type();
    int const id = placement_.dlpack_device_id();
    void* const ptr = const_cast<void*>(data);
    switch (framework) {
      case kNumpy:
        slot.object = nb::ndarray<nb::numpy>(ptr, spec.ndim, spec.dims, owner_, nullptr, dtype, type, id).cast();
        break;
      case kTorch:
        slot.object = nb::ndarray<nb::pytorch>(ptr, spec.ndim, spec.dims, owner_, nullptr, dtype, type, id).cast();
        if (torch_fp8 && !frameworks().torch_fp8_e4m3fn.is_none())
          slot.object = slot.object.attr("view")(frameworks().torch_fp8_e4m3fn);
        break;
      default:
        slot.object = nb::ndarray<>(ptr, spec.ndim, spec.dims, owner_, nullptr, dtype, type, id).cast();
        break;
    }
    slot.data = data;
  }
  return slot.object;
}

// The first rows of the slot's cached view, itself cached: an eager call of the same row count returns the same slice
// again (a framework's slice costs as much as the rest of the call), as lazy calls return the same views.
nb::object PyEpBuffer::cached_head(View& slot, nb::object const& full, int64_t rows) {
  if (full.is_none()) return full;
  if (slot.head_rows != rows || !slot.head.is_valid() || !slot.head_base.is(full)) {
    slot.head = head(full, rows);
    slot.head_base = full;
    slot.head_rows = rows;
  }
  return slot.head;
}

PyDispatchResult PyEpBuffer::result(DispatchResult const& got, Framework framework, bool eager) {
  Views& v = views_[framework];
  size_t const cap = static_cast<size_t>(capacity_);
  size_t const topk = static_cast<size_t>(topk_);
  size_t const local = static_cast<size_t>(num_local_);
  PyDispatchResult out;
  out.recv_x = view(v.recv_x, got.recv_x, framework, recv_x_spec_);
  out.recv_topk_idx = view(v.recv_topk_idx, got.recv_topk_idx, framework, ViewSpec(kI32, {cap, topk}));
  out.recv_topk_weights = view(v.recv_topk_weights, got.recv_topk_weights, framework, ViewSpec(kF32, {cap, topk}));
  out.recv_src = view(v.recv_src, got.recv_src, framework, ViewSpec(kI32, {cap, 2}));
  out.num_recv = view(v.num_recv, got.num_recv, framework, ViewSpec(kI32, {1}));
  out.expert_counts = view(v.expert_counts, got.expert_counts, framework, ViewSpec(kI32, {local}));
  size_t const slots = static_cast<size_t>(got.expert_slots);
  out.expert_x = view(v.expert_x, got.expert_x, framework, expert_x_spec_);
  out.expert_src_row = view(v.expert_src_row, got.expert_src_row, framework, ViewSpec(kI32, {local, slots}));
  if (quantized_) {
    out.recv_scales = view(v.recv_scales, got.recv_scales, framework, recv_scales_spec_);
    out.recv_token_scales = view(v.recv_token_scales, got.recv_token_scales, framework, ViewSpec(kF32, {cap}));
    out.expert_scales = view(v.expert_scales, got.expert_scales, framework, expert_scales_spec_);
    out.expert_token_scales =
        view(v.expert_token_scales, got.expert_token_scales, framework, ViewSpec(kF32, {local, slots}));
  } else {
    out.recv_scales = out.recv_token_scales = out.expert_scales = out.expert_token_scales = nb::none();
  }
  if (got.num_recv_host >= 0) out.num_recv_host = got.num_recv_host;
  if (eager && got.num_recv_host >= 0) {
    int64_t const rows = got.num_recv_host;
    out.recv_x = cached_head(v.recv_x, out.recv_x, rows);
    out.recv_topk_idx = cached_head(v.recv_topk_idx, out.recv_topk_idx, rows);
    out.recv_topk_weights = cached_head(v.recv_topk_weights, out.recv_topk_weights, rows);
    out.recv_src = cached_head(v.recv_src, out.recv_src, rows);
    if (quantized_) {
      // NOTE: only the row-major scales have rows as their first dimension; the other layouts stay whole tensors of
      // recv_capacity rows (their strides depend on the row count).
      if (scale_layout_ == ScaleLayout::row_major) out.recv_scales = cached_head(v.recv_scales, out.recv_scales, rows);
      out.recv_token_scales = cached_head(v.recv_token_scales, out.recv_token_scales, rows);
    }
  }
  out.recv_capacity = got.recv_capacity;
  out.masked_entries = got.masked_entries;
  out.dropped_rows = got.dropped_rows;
  out.expert_slots = got.expert_slots;
  return out;
}

// The Python object of a result: the last one again when every field is the same (lazy calls return the same cached
// views each time; a DispatchResult is read-only), else a new one, so that a call creates no object.
ResultObject PyEpBuffer::result_object(PyDispatchResult&& got) {
  if (last_result_.is_valid()) {
    PyDispatchResult const& last = *nb::inst_ptr<PyDispatchResult>(last_result_);
    if (same_result(last, got)) return nb::borrow<ResultObject>(last_result_);
  }
  last_result_ = nb::cast(std::move(got));
  return nb::borrow<ResultObject>(last_result_);
}

}  // namespace ferry::python
