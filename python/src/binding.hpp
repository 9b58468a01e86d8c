// ferry._ext: the nanobind module over Ferry's C++ API (include/ferry/). Thin by design:
// - arrays come in through torch's DLPack C exchange API (torch tensors, where torch has it), DLPack capsules or the
//   buffer protocol (nb::ndarray); since the C++ API takes raw pointers, the shape, dtype, contiguity and device
//   checks a pointer cannot carry are made here, as InputError in the library's own message format;
// - outputs are views of the EpBuffer's buffers (DispatchResult pointers), created once per (buffer, framework) and
//   reused, so a call allocates only the small view objects it returns (a slice in eager mode, the result record
//   when it differs from the last one);
// - every C++ call that can block or run long is made with the GIL released.
//
// The one header between the binding's files, one concern each:
//   dlpack.cpp     frameworks (torch, NumPy, DLPack) and the import and checks of array arguments;
//   bootstrap.cpp  a Bootstrap implemented in Python, and the communicator's creation;
//   ep_buffer.cpp  PyEpBuffer: the EpBuffer's calls with Python arguments, and the views they return;
//   module.cpp     the module definition (what Python sees, with its docstrings).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
// NOTE: every file of the binding sees the same type casters (a cast compiled without one is a runtime bad_cast)
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>

#include "ferry/bootstrap.hpp"
#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "ferry/wire_format.hpp"

namespace nb = nanobind;

namespace ferry::python {

// ---- frameworks and array arguments (dlpack.cpp) ------------------------------------------------------------------

// The framework outputs are returned in: the one the call's main input came from.
enum Framework { kNumpy = 0, kTorch = 1, kDlpack = 2, kNumFrameworks = 3 };

inline constexpr nb::dlpack::dtype kBf16{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
inline constexpr nb::dlpack::dtype kU16 = nb::dtype<uint16_t>();
inline constexpr nb::dlpack::dtype kI32 = nb::dtype<int32_t>();
inline constexpr nb::dlpack::dtype kI64 = nb::dtype<int64_t>();
inline constexpr nb::dlpack::dtype kF32 = nb::dtype<float>();
inline constexpr nb::dlpack::dtype kU8 = nb::dtype<uint8_t>();
inline constexpr nb::dlpack::dtype kI8 = nb::dtype<int8_t>();
// One-byte float types of DLPack: e4m3 (the fp8 payload, nvfp4's block scales) and UE8M0 (power-of-two scales).
inline constexpr nb::dlpack::dtype kFp8{static_cast<uint8_t>(nb::dlpack::dtype_code::Float8_E4M3FN), 8, 1};
inline constexpr nb::dlpack::dtype kE8M0{static_cast<uint8_t>(nb::dlpack::dtype_code::Float8_E8M0FNU), 8, 1};

struct DlpackExchangeApi;  // dlpack.cpp: the fields of DLPack's C exchange API the binding reads

// Types and callables found lazily (numpy at the first call that needs it; torch once something imported it).
struct Frameworks {
  PyTypeObject* numpy_ndarray = nullptr;
  PyTypeObject* torch_tensor = nullptr;
  nb::object numpy_empty;
  nb::object torch_empty;
  nb::object torch_bf16;
  nb::object torch_f32;
  nb::object torch_uint8;
  nb::object torch_int32, torch_int64;
  // torch's one-byte float dtypes (None where this torch lacks them): outputs of fp8 payload are uint8 views made
  // float8_e4m3fn with Tensor.view(dtype), inputs of these dtypes are viewed as uint8 before import (both work on
  // every torch with float8, whether or not its DLPack knows the type).
  nb::object torch_fp8_e4m3fn, torch_fp8_e8m0fnu, torch_fp4_e2m1fn_x2;
  nb::object torch_to_dlpack;        // torch._C._to_dlpack (None where this torch lacks it)
  nb::object torch_current_stream;   // (device index) -> raw cudaStream_t as int
  bool torch_stream_is_raw = false;  // torch._C._cuda_getCurrentRawStream (an int directly) vs current_stream()
  // torch.Tensor.__dlpack_c_exchange_api__'s table (null where this torch has none, or use_exchange_api(false))
  DlpackExchangeApi const* torch_exchange = nullptr;
  DlpackExchangeApi const* torch_exchange_found = nullptr;  // what torch has, whether used or not
};

Frameworks& frameworks();
PyTypeObject* numpy_ndarray_type();
// torch.Tensor when torch is loaded (never imports torch itself).
PyTypeObject* torch_tensor_type();
// Whether the imports and stream lookups take torch's C exchange API where torch has one (the default), or the ways
// a torch without it is read (a DLPack capsule, a Python call for the stream). Returns whether this torch has one.
// For the tests, which run the same calls both ways.
bool use_exchange_api(bool on);
// Fills `out` with a torch tensor's DLTensor through torch's C exchange API: no allocation, no Python call. False for
// anything else, a torch without the API, or a tensor it refuses (the caller then imports it the other way).
bool torch_dltensor(nb::handle object, nb::dlpack::dltensor& out);
Framework framework_of(nb::handle array);
// The current torch stream of a GPU as a cudaStream_t.
cudaStream_t torch_current_stream(int device);

std::string python_type_name(nb::handle object);
char const* dtype_name(nb::dlpack::dtype dtype);

// An imported array argument: the DLTensor fields the checks and the C++ call read. It borrows what it describes:
// data, shape and strides stay valid while the Python object it was read from lives unchanged (an argument of the
// running call); an import through nanobind keeps its ndarray here.
class ArrayArg {
 public:
  ArrayArg() = default;
  explicit ArrayArg(nb::dlpack::dltensor const& tensor) : tensor_(tensor) {}
  template <typename... Args>
  explicit ArrayArg(nb::ndarray<Args...> const& array) : keep_(array) {
    tensor_.data = const_cast<void*>(static_cast<void const*>(array.data()));  // byte_offset included
    tensor_.device = {array.device_type(), array.device_id()};
    tensor_.ndim = static_cast<int32_t>(array.ndim());
    tensor_.dtype = array.dtype();
    tensor_.shape = const_cast<int64_t*>(array.shape_ptr());
    tensor_.strides = const_cast<int64_t*>(array.stride_ptr());
  }

  size_t ndim() const { return static_cast<size_t>(tensor_.ndim); }
  size_t shape(size_t i) const { return static_cast<size_t>(tensor_.shape[i]); }
  // NOTE: DLPack before 1.2 allows null strides for a row-major array
  int64_t stride(size_t i) const {
    if (tensor_.strides) return tensor_.strides[i];
    int64_t stride = 1;
    for (size_t j = i + 1; j < ndim(); ++j) stride *= tensor_.shape[j];
    return stride;
  }
  size_t size() const {
    size_t n = 1;
    for (size_t i = 0; i < ndim(); ++i) n *= shape(i);
    return n;
  }
  nb::dlpack::dtype dtype() const { return tensor_.dtype; }
  int device_type() const { return static_cast<int>(tensor_.device.device_type); }
  int device_id() const { return static_cast<int>(tensor_.device.device_id); }
  void* data() const { return static_cast<char*>(tensor_.data) + tensor_.byte_offset; }

 private:
  nb::dlpack::dltensor tensor_;
  nb::ndarray<nb::ro> keep_;
};

std::string shape_text(ArrayArg const& array);
// Row-major and dense (dimensions of extent 1 may have any stride).
bool is_c_contiguous(ArrayArg const& array);

// Everything a call needs to know about where its arrays must live.
class Placement {
 public:
  Placement(Backend backend, int device) : backend_(backend), device_(device) {}

  Backend backend() const { return backend_; }
  int device() const { return device_; }
  int dlpack_device_type() const;
  int dlpack_device_id() const;

  enum class Access { read, write };

  // Imports `object` as an array without copying (no conversion), checking placement, contiguity and rank:
  // dimensions of `dims` < 0 are free (named free_name in the message).
  ArrayArg import(nb::handle object, char const* name, std::initializer_list<int64_t> dims, char const* free_name,
                  Access access = Access::read) const;

  // Imports `object` as an array, checking only that it is one and where it lives (for an argument the C++ call
  // refuses by itself, whatever its shape). A torch tensor is read through torch's C exchange API where torch has
  // one (torch tensors are writable), else through a DLPack capsule or the buffer protocol (nanobind).
  ArrayArg import_any(nb::handle object, char const* name, Access access = Access::read) const;

 private:
  Backend backend_;
  int device_;
};

// InputError unless `got` is one of `allowed` (allowed_text says which, for the message).
void check_dtype(nb::dlpack::dtype got, char const* name, std::initializer_list<nb::dlpack::dtype> allowed,
                 char const* allowed_text);
// A stream argument: None (the default stream), an int (a cudaStream_t) or an object with cuda_stream.
cudaStream_t stream_from(nb::handle stream);

// ---- the bootstrap (bootstrap.cpp) ---------------------------------------------------------------------------------

// A Bootstrap that calls back into a Python object (ferry.init(group=...) passes one built over torch.distributed).
std::unique_ptr<Bootstrap> make_python_bootstrap(nb::object impl);
// A communicator over `bootstrap` (collective; the GIL is released while the ranks meet).
std::shared_ptr<Communicator> create_communicator(std::unique_ptr<Bootstrap> bootstrap, std::string const& backend,
                                                  int device, std::string const& topology);

// ---- EpBuffer (ep_buffer.cpp) --------------------------------------------------------------------------------------

// What one dispatch returns: views of the EpBuffer's buffers (valid until its next dispatch), None where the call
// filled nothing.
struct PyDispatchResult {
  nb::object recv_x, recv_topk_idx, recv_topk_weights, recv_src, num_recv, expert_counts, expert_x, expert_src_row;
  nb::object recv_scales, recv_token_scales, expert_scales, expert_token_scales;  // quantized delivery
  std::optional<int64_t> num_recv_host;
  int recv_capacity = 0;
  int expert_slots = 0;
  int64_t masked_entries = 0;  // rank masking: this call's entries not sent (their rank is masked)
  int64_t dropped_rows = 0;    // rows the call did not deliver, over every rank (DispatchResult::dropped_rows)
};

// A DispatchResult as the Python object a call returns (typed as one in the signature).
using ResultObject = nb::typed<nb::object, PyDispatchResult>;

// A DispatchHandle (include/ferry/ep.hpp) with the storage the binding gave it: on the cuda backend a torch uint8
// tensor of handle_bytes() from torch's caching allocator (a handle per forward call costs no cudaMalloc), kept alive
// as long as the handle; on the cpu backend none (the handle lives in host memory). num_recv_host: the rows of the
// dispatch that saved it, when that dispatch knew them on the host (the binding's row checks of later calls).
struct PyDispatchHandle {
  DispatchHandle handle;
  nb::object storage;
  int64_t num_recv_host = -1;
};

// An EpBuffer with Python arguments: checks what a raw pointer cannot carry, runs the C++ call with the GIL released,
// and returns views of the buffer's memory (module.cpp documents each call).
class PyEpBuffer {
 public:
  PyEpBuffer(std::shared_ptr<Communicator> comm, EpConfig const& config);

  EpBuffer& buffer() const { return *buffer_; }
  Placement const& placement() const { return placement_; }

  struct Inputs {
    DispatchArgs args;
    Framework framework;
    cudaStream_t stream;
    nb::object x_bytes, scales_bytes;  // uint8 views made of torch fp8 / fp4 inputs, alive for the call
  };
  struct CombineInputs {
    CombineArgs args;
    cudaStream_t stream;
    nb::object y;
  };

  Inputs dispatch_inputs(nb::handle x, nb::handle topk_idx, nb::handle topk_weights, nb::handle x_scales,
                         nb::handle x_token_scales, bool expand, bool eager, nb::handle stream,
                         bool return_recv_hook = false, bool cached = false, int x_repeat = 1) const;
  CombineInputs combine_inputs(nb::handle x, std::string const& layout, nb::handle out, bool eager, nb::handle stream,
                               int num_tokens, int64_t num_recv_host, bool return_recv_hook = false, int group = 1,
                               nb::handle group_weights = nb::none()) const;

  ResultObject dispatch(nb::handle x, nb::handle topk_idx, nb::handle topk_weights, nb::handle x_scales,
                        nb::handle x_token_scales, bool expand, bool eager, bool return_recv_hook,
                        nb::handle save_handle, nb::handle handle, nb::handle stream, int x_repeat);
  nb::tuple dispatch_owned(nb::handle x, nb::handle topk_idx, nb::handle topk_weights, nb::handle x_scales, bool eager,
                           bool save_handle, nb::handle handle, nb::handle stream, bool with_src);
  nb::object rank_counts(nb::handle handle, nb::handle out, nb::handle stream);
  ResultObject complete_dispatch(nb::handle stream);
  void complete_combine(nb::handle stream);
  nb::object combine(nb::handle x, std::string const& layout, nb::handle out, bool eager, bool return_recv_hook,
                     nb::handle handle, nb::handle stream, int group, nb::handle group_weights);
  PyDispatchHandle make_handle(nb::handle device = nb::handle()) const;
  nb::object dispatch_backward(nb::handle grad, nb::handle handle, std::string const& layout, nb::handle out, bool fp32,
                               bool eager, nb::handle stream);
  nb::tuple combine_backward(nb::handle grad_y, nb::handle handle, std::string const& layout, nb::handle x,
                             std::optional<bool> want_grad_weights, nb::handle grad_topk_weights, bool eager,
                             nb::handle stream);
  double time_cpp_loop(int iters, nb::handle x, nb::handle topk_idx, nb::handle topk_weights, bool expand,
                       nb::handle combine_x, std::string const& layout, nb::handle out, bool eager, nb::handle stream);

  int num_local_experts() const { return num_local_; }
  int recv_capacity() const { return capacity_; }
  int expert_slots() const { return slots_; }

  // dtype and shape of a view (at most 4 dimensions)
  struct ViewSpec {
    nb::dlpack::dtype dtype = kU8;
    size_t ndim = 0;
    size_t dims[4] = {};
    ViewSpec() = default;
    ViewSpec(nb::dlpack::dtype type, std::initializer_list<size_t> shape) : dtype(type), ndim(shape.size()) {
      std::copy(shape.begin(), shape.end(), dims);
    }
  };

 private:
  class Exclusive;
  enum class Leg { dispatch, combine };
  struct CombineBackwardInputs;
  // dispatch_owned's fresh outputs and the copy that fills them
  struct OwnedOutputs {
    nb::object recv_x, recv_scales, ids, weights, src;
    ReceivedCopy to;
  };

  // A view of one of the buffer's arrays, cached per framework: made again only when its pointer changes.
  struct View {
    void const* data = nullptr;
    nb::object object;
    // the last slice of object handed out by an eager call: object[:head_rows] (head_base: the object it slices)
    nb::object head, head_base;
    int64_t head_rows = -1;
  };
  struct Views {
    View recv_x, recv_topk_idx, recv_topk_weights, recv_src, num_recv, expert_counts, expert_x, expert_src_row;
    View recv_scales, recv_token_scales, expert_scales, expert_token_scales;
  };

  // the steps of dispatch_inputs
  ArrayArg import_x(Inputs& in, nb::handle x, bool prequantized) const;
  void import_x_scales(Inputs& in, nb::handle x_scales, nb::handle x_token_scales, int64_t x_rows) const;
  void import_routing(Inputs& in, nb::handle topk_idx, nb::handle topk_weights, bool cached, int64_t x_rows,
                      int x_repeat) const;

  Inputs dispatch_inputs_with(nb::handle x, nb::handle topk_idx, nb::handle topk_weights, nb::handle x_scales,
                              nb::handle x_token_scales, bool expand, bool eager, nb::handle stream,
                              bool return_recv_hook, PyDispatchHandle* save, PyDispatchHandle* cached,
                              int x_repeat = 1) const;
  DispatchResult run_dispatch(Inputs const& in, PyDispatchHandle* save);
  OwnedOutputs owned_outputs(nb::handle device, int64_t rows, bool routing, IndexType idx_type, bool with_src) const;
  CombineBackwardInputs combine_backward_inputs(nb::handle grad_y, PyDispatchHandle* h, bool expert_major, nb::handle x,
                                                std::optional<bool> want_grad_weights, nb::handle grad_topk_weights,
                                                bool eager, nb::handle stream) const;

  template <typename Checks>
  auto checked(Leg leg, nb::handle stream, nb::handle like, Checks&& checks) -> decltype(checks());
  cudaStream_t refusal_stream(nb::handle stream, nb::handle like) const;
  void remember_dispatch(int num_tokens, DispatchResult const& got, Framework framework, bool eager);
  void forget_dispatch();
  void use_handle(PyDispatchHandle const& handle);
  cudaStream_t resolve_stream(nb::handle stream, Framework framework) const;

  nb::object allocate(Framework framework, nb::handle like, int64_t rows, int64_t cols, bool fp32,
                      char const* call) const;
  nb::object allocate_rows(Framework framework, nb::handle like, int64_t rows, bool fp32, char const* call) const;
  ArrayArg grad_rows(nb::handle grad, char const* name, bool expert_major, int64_t num_recv_host,
                     char const* call) const;

  ViewSpec row_spec(size_t groups, size_t rows, size_t row_bytes) const;
  ViewSpec scale_spec(size_t groups, int rows) const;
  nb::object view(View& slot, void const* data, Framework framework, ViewSpec const& spec);
  static nb::object cached_head(View& slot, nb::object const& full, int64_t rows);
  PyDispatchResult result(DispatchResult const& got, Framework framework, bool eager);
  ResultObject result_object(PyDispatchResult&& got);

  Placement placement_;
  std::shared_ptr<EpBuffer> buffer_;
  nb::object owner_;
  int hidden_ = 0;
  int topk_ = 0;
  int num_local_ = 0;
  int capacity_ = 0;
  int slots_ = 0;
  int max_tokens_ = 0;
  WireFormat format_ = WireFormat::bf16;  // dispatch_format
  WireRowLayout wire_;                    // of dispatch_format
  ScaleLayout scale_layout_ = ScaleLayout::row_major;
  bool quantized_ = false;  // EpConfig::delivers_quantized
  ViewSpec recv_x_spec_, expert_x_spec_, recv_scales_spec_, expert_scales_spec_;
  int last_num_tokens_ = -1;    // of the dispatch combine refers to (y's rows); -1: none
  int hooked_num_tokens_ = -1;  // of a dispatch whose receive half is pending
  int64_t last_num_recv_host_ = -1;
  Framework last_framework_ = kNumpy;  // of the last dispatch (the completion of a hook returns views in it)
  bool last_eager_ = true;
  Views views_[kNumFrameworks];
  nb::object last_result_;  // the DispatchResult object dispatch or complete_dispatch returned last
  std::atomic<bool> busy_{false};
};

}  // namespace ferry::python
