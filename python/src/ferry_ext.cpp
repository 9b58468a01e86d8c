// ferry._ext: the nanobind module over Ferry's C++ API (include/ferry/). Thin by design:
// - arrays come in through torch's DLPack C exchange API (torch tensors, where torch has it), DLPack capsules or the
//   buffer protocol (nb::ndarray); since the C++ API takes raw pointers, the shape, dtype, contiguity and device
//   checks a pointer cannot carry are made here, as InputError in the library's own message format;
// - outputs are views of the EpBuffer's buffers (DispatchResult pointers), created once per (buffer, framework) and
//   reused, so a call allocates only the small view objects it returns (a slice in eager mode, the result record
//   when it differs from the last one);
// - every C++ call that can block or run long is made with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if FERRY_HAVE_CUDA
#include "core/cuda_check.hpp"
#endif

#include "core/launcher.hpp"
#include "ferry/bootstrap.hpp"
#include "ferry/communicator.hpp"
#include "ferry/env.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "ferry/wire_format.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace ferry::python {
namespace {

using detail::concat;

// ---- frameworks --------------------------------------------------------------------------------------------------

// The framework outputs are returned in: the one the call's main input came from.
enum Framework { kNumpy = 0, kTorch = 1, kDlpack = 2, kNumFrameworks = 3 };

constexpr nb::dlpack::dtype kBf16{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
constexpr nb::dlpack::dtype kU16 = nb::dtype<uint16_t>();
constexpr nb::dlpack::dtype kI32 = nb::dtype<int32_t>();
constexpr nb::dlpack::dtype kI64 = nb::dtype<int64_t>();
constexpr nb::dlpack::dtype kF32 = nb::dtype<float>();
constexpr nb::dlpack::dtype kU8 = nb::dtype<uint8_t>();
constexpr nb::dlpack::dtype kI8 = nb::dtype<int8_t>();
// One-byte float types of DLPack: e4m3 (the fp8 payload, nvfp4's block scales) and UE8M0 (power-of-two scales).
constexpr nb::dlpack::dtype kFp8{static_cast<uint8_t>(nb::dlpack::dtype_code::Float8_E4M3FN), 8, 1};
constexpr nb::dlpack::dtype kE8M0{static_cast<uint8_t>(nb::dlpack::dtype_code::Float8_E8M0FNU), 8, 1};

// DLPack's C exchange API (dlpack.h 1.2+, DLPackExchangeAPI), the fields read here: a C function that fills a
// DLTensor from a framework's Python object without allocating, and the framework's current stream of a device.
// torch >= 2.11 publishes it as torch.Tensor.__dlpack_c_exchange_api__, a PyCapsule named "dlpack_exchange_api".
// nb::dlpack::dltensor is DLTensor's layout.
struct DlpackExchangeApi {
  struct Header {
    uint32_t major, minor;   // DLPackVersion
    Header const* prev_api;  // an older table of the chain (a consumer of an older major version walks it)
  } header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  // 0, or -1 with a Python exception set; shape, strides and data are the object's own (valid while it lives)
  int (*dltensor_from_py_object_no_sync)(void* py_object, nb::dlpack::dltensor* out);
  // 0, or -1 with a Python exception set (DLDeviceType, device id, the stream out)
  int (*current_work_stream)(int device_type, int32_t device_id, void** out_stream);
};

// The table of major version 1 in the chain of a __dlpack_c_exchange_api__ capsule, if it has the two functions.
DlpackExchangeApi const* exchange_api_of(nb::handle capsule) {
  if (!PyCapsule_IsValid(capsule.ptr(), "dlpack_exchange_api")) return nullptr;
  auto const* header =
      static_cast<DlpackExchangeApi::Header const*>(PyCapsule_GetPointer(capsule.ptr(), "dlpack_exchange_api"));
  while (header != nullptr && header->major > 1) header = header->prev_api;
  // NOTE: the table came with DLPack 1.2; its layout is fixed within a major version
  if (header == nullptr || header->major != 1 || header->minor < 2) return nullptr;
  auto const* api = reinterpret_cast<DlpackExchangeApi const*>(header);
  return api->dltensor_from_py_object_no_sync && api->current_work_stream ? api : nullptr;
}

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

Frameworks& frameworks() {
  static Frameworks* state = new Frameworks();  // NOTE: leaked on purpose: no Python calls at process teardown
  return *state;
}

PyTypeObject* numpy_ndarray_type() {
  Frameworks& f = frameworks();
  if (!f.numpy_ndarray) {
    nb::object np = nb::module_::import_("numpy");
    f.numpy_ndarray = reinterpret_cast<PyTypeObject*>(np.attr("ndarray").ptr());
    f.numpy_empty = np.attr("empty");
  }
  return f.numpy_ndarray;
}

// torch.Tensor when torch is loaded (never imports torch itself).
PyTypeObject* torch_tensor_type() {
  Frameworks& f = frameworks();
  if (!f.torch_tensor) {
    PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed
    if (!torch) return nullptr;
    nb::handle module(torch);
    if (!nb::hasattr(module, "Tensor")) return nullptr;  // torch still importing
    f.torch_tensor = reinterpret_cast<PyTypeObject*>(module.attr("Tensor").ptr());
    f.torch_empty = module.attr("empty");
    f.torch_bf16 = module.attr("bfloat16");
    f.torch_f32 = module.attr("float32");
    f.torch_uint8 = module.attr("uint8");
    f.torch_int32 = module.attr("int32");
    f.torch_int64 = module.attr("int64");
    f.torch_fp8_e4m3fn = nb::getattr(module, "float8_e4m3fn", nb::none());
    f.torch_fp8_e8m0fnu = nb::getattr(module, "float8_e8m0fnu", nb::none());
    f.torch_fp4_e2m1fn_x2 = nb::getattr(module, "float4_e2m1fn_x2", nb::none());
    f.torch_to_dlpack = nb::getattr(module.attr("_C"), "_to_dlpack", nb::none());
    // NOTE: the capsule is a class attribute of torch.Tensor, alive as long as torch (never unloaded)
    f.torch_exchange_found =
        exchange_api_of(nb::getattr(module.attr("Tensor"), "__dlpack_c_exchange_api__", nb::none()));
    f.torch_exchange = f.torch_exchange_found;
  }
  return f.torch_tensor;
}

// Whether the imports and stream lookups below take torch's C exchange API where torch has one (the default), or the
// ways a torch without it is read (a DLPack capsule, a Python call for the stream). Returns whether this torch has
// one. For the tests, which run the same calls both ways.
bool use_exchange_api(bool on) {
  Frameworks& f = frameworks();
  if (!torch_tensor_type()) return false;
  f.torch_exchange = on ? f.torch_exchange_found : nullptr;
  return f.torch_exchange_found != nullptr;
}

// Fills `out` with a torch tensor's DLTensor through torch's C exchange API: no allocation, no Python call. False for
// anything else, a torch without the API, or a tensor it refuses (the caller then imports it the other way).
bool torch_dltensor(nb::handle object, nb::dlpack::dltensor& out) {
  PyTypeObject* const torch = torch_tensor_type();
  DlpackExchangeApi const* const api = frameworks().torch_exchange;
  if (!api || !PyType_IsSubtype(Py_TYPE(object.ptr()), torch)) return false;
  if (api->dltensor_from_py_object_no_sync(object.ptr(), &out) == 0) return true;
  PyErr_Clear();
  return false;
}

// The DLPack capsule of a torch tensor straight from torch's C++ exporter, or an invalid object (anything else, or
// the exporter refused: the caller then imports `object` itself and reports its own error).
// NOTE: nanobind imports a tensor through Tensor.__dlpack__, Python code in torch (argument checks, stream
// handling); torch._C._to_dlpack is the same export without it, a few microseconds less per array and call.
// Nothing it skips applies here: no stream is passed (the calls take their own), and the checks for autograd and
// for conjugate / negative views (complex dtypes) do not affect reading the raw data.
nb::object torch_capsule(nb::handle object) {
  PyTypeObject* const torch = torch_tensor_type();
  Frameworks& f = frameworks();
  if (!torch || !PyType_IsSubtype(Py_TYPE(object.ptr()), torch) || f.torch_to_dlpack.is_none()) return {};
  PyObject* const capsule = PyObject_CallOneArg(f.torch_to_dlpack.ptr(), object.ptr());
  if (!capsule) PyErr_Clear();
  return nb::steal(capsule);
}

Framework framework_of(nb::handle array) {
  PyTypeObject* const type = Py_TYPE(array.ptr());
  if (PyTypeObject* torch = torch_tensor_type(); torch && PyType_IsSubtype(type, torch)) return kTorch;
  if (PyType_IsSubtype(type, numpy_ndarray_type())) return kNumpy;
  return kDlpack;
}

// The current torch stream of a GPU as a cudaStream_t.
cudaStream_t torch_current_stream(int device) {
  Frameworks& f = frameworks();
  if (f.torch_exchange != nullptr) {
    void* stream = nullptr;
    if (f.torch_exchange->current_work_stream(nb::device::cuda::value, device, &stream) != 0) throw nb::python_error();
    return static_cast<cudaStream_t>(stream);
  }
  if (!f.torch_current_stream.is_valid()) {
    nb::object c = nb::module_::import_("torch._C");
    // NOTE: torch._C._cuda_getCurrentRawStream returns the raw pointer as an int, several times cheaper than
    // torch.cuda.current_stream(device).cuda_stream, which is the fallback (and the documented meaning).
    f.torch_stream_is_raw = nb::hasattr(c, "_cuda_getCurrentRawStream");
    f.torch_current_stream = f.torch_stream_is_raw ? c.attr("_cuda_getCurrentRawStream")
                                                   : nb::module_::import_("torch.cuda").attr("current_stream");
  }
  nb::object got = f.torch_current_stream(device);
  if (!f.torch_stream_is_raw) got = got.attr("cuda_stream");
  return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(nb::cast<uint64_t>(got)));
}

// ---- argument conversion -----------------------------------------------------------------------------------------

std::string python_type_name(nb::handle object) {
  return nb::cast<std::string>(nb::type_name(object.type()));
}

char const* dtype_name(nb::dlpack::dtype dtype) {
  auto const code = static_cast<nb::dlpack::dtype_code>(dtype.code);
  if (dtype.lanes != 1) return "a vector dtype";
  switch (code) {
    case nb::dlpack::dtype_code::Int:
      return dtype.bits == 8 ? "int8" : dtype.bits == 16 ? "int16" : dtype.bits == 32 ? "int32" : "int64";
    case nb::dlpack::dtype_code::UInt:
      return dtype.bits == 8 ? "uint8" : dtype.bits == 16 ? "uint16" : dtype.bits == 32 ? "uint32" : "uint64";
    case nb::dlpack::dtype_code::Float:
      return dtype.bits == 16 ? "float16" : dtype.bits == 32 ? "float32" : "float64";
    case nb::dlpack::dtype_code::Bfloat:
      return "bfloat16";
    case nb::dlpack::dtype_code::Bool:
      return "bool";
    case nb::dlpack::dtype_code::Float8_E4M3FN:
      return "float8_e4m3fn";
    case nb::dlpack::dtype_code::Float8_E8M0FNU:
      return "float8_e8m0fnu";
    case nb::dlpack::dtype_code::Float8_E5M2:
      return "float8_e5m2";
    case nb::dlpack::dtype_code::Float4_E2M1FN:
      return "float4_e2m1fn";
    default:
      return "an unsupported dtype";
  }
}

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

std::string shape_text(ArrayArg const& array) {
  std::string out = "[";
  for (size_t i = 0; i < array.ndim(); ++i) out += concat(i ? ", " : "", array.shape(i));
  return out + "]";
}

std::string device_text(int device_type, int device_id) {
  if (device_type == nb::device::cpu::value) return "cpu";
  if (device_type == nb::device::cuda_host::value) return "cuda_host";
  if (device_type == nb::device::cuda::value) return concat("cuda:", device_id);
  return concat("DLPack device type ", device_type);
}

// Row-major and dense (dimensions of extent 1 may have any stride).
bool is_c_contiguous(ArrayArg const& array) {
  if (array.size() == 0) return true;
  int64_t expected = 1;
  for (size_t i = array.ndim(); i-- > 0;) {
    if (array.shape(i) != 1 && array.stride(i) != expected) return false;
    expected *= static_cast<int64_t>(array.shape(i));
  }
  return true;
}

// The allowed shapes as text: dimensions < 0 are free.
std::string wanted_shape(std::initializer_list<int64_t> dims, char const* free_name) {
  std::string out = "[";
  bool first = true;
  for (int64_t dim : dims) {
    out += first ? "" : ", ";
    out += dim < 0 ? std::string(free_name) : std::to_string(dim);
    first = false;
  }
  return out + "]";
}

}  // namespace

// Everything a call needs to know about where its arrays must live.
class Placement {
 public:
  Placement(Backend backend, int device) : backend_(backend), device_(device) {}

  Backend backend() const { return backend_; }
  int device() const { return device_; }
  int dlpack_device_type() const {
    return backend_ == Backend::cuda ? nb::device::cuda::value : nb::device::cpu::value;
  }
  int dlpack_device_id() const { return backend_ == Backend::cuda ? device_ : 0; }

  enum class Access { read, write };

  // Imports `object` as an array without copying (no conversion), checking placement, contiguity and rank.
  ArrayArg import(nb::handle object, char const* name, std::initializer_list<int64_t> dims, char const* free_name,
                  Access access = Access::read) const {
    ArrayArg array = import_any(object, name, access);
    bool shape_ok = array.ndim() == dims.size();
    size_t i = 0;
    for (int64_t dim : dims) {
      if (shape_ok && dim >= 0 && static_cast<int64_t>(array.shape(i)) != dim) shape_ok = false;
      ++i;
    }
    FERRY_CHECK_INPUT(shape_ok, name, " has shape ", shape_text(array), "; expected ", wanted_shape(dims, free_name));
    FERRY_CHECK_INPUT(is_c_contiguous(array), name, " of shape ", shape_text(array),
                      " is not contiguous (row-major); pass a contiguous array (.contiguous() / np.ascontiguousarray)");
    return array;
  }

  // Imports `object` as an array, checking only that it is one and where it lives (for an argument the C++ call
  // refuses by itself, whatever its shape). A torch tensor is read through torch's C exchange API where torch has
  // one (torch tensors are writable), else through a DLPack capsule or the buffer protocol (nanobind).
  ArrayArg import_any(nb::handle object, char const* name, Access access = Access::read) const {
    ArrayArg array;
    if (nb::dlpack::dltensor tensor; torch_dltensor(object, tensor)) {
      array = ArrayArg(tensor);
    } else {
      bool const imported = access == Access::read ? import_ndarray<nb::ndarray<nb::ro>>(object, array)
                                                   : import_ndarray<nb::ndarray<>>(object, array);
      FERRY_CHECK_INPUT(imported, name, " must be an array (DLPack or the buffer protocol: NumPy, torch, ...)",
                        access == Access::read ? "" : " that is writable", ", got ", python_type_name(object));
    }
    int const type = array.device_type();
    if (backend_ == Backend::cpu) {
      FERRY_CHECK_INPUT(type == nb::device::cpu::value || type == nb::device::cuda_host::value, name, " is on ",
                        device_text(type, array.device_id()),
                        "; the cpu backend takes host arrays (NumPy, torch CPU tensors)");
    } else {
      FERRY_CHECK_INPUT(type == nb::device::cuda::value && array.device_id() == device_, name, " is on ",
                        device_text(type, array.device_id()), "; this communicator's GPU is cuda:", device_);
    }
    return array;
  }

 private:
  // nanobind's import of `object` (a torch tensor through its DLPack capsule) into `out`; false if it is no array.
  template <typename Array>
  static bool import_ndarray(nb::handle object, ArrayArg& out) {
    Array array;
    nb::object const capsule = torch_capsule(object);
    bool const imported = (capsule.is_valid() && nb::try_cast(capsule, array, /*convert=*/false)) ||
                          nb::try_cast(object, array, /*convert=*/false);
    if (imported) out = ArrayArg(array);
    return imported;
  }

  Backend backend_;
  int device_;
};

namespace {

void check_dtype(nb::dlpack::dtype got, char const* name, std::initializer_list<nb::dlpack::dtype> allowed,
                 char const* allowed_text) {
  for (nb::dlpack::dtype dtype : allowed)
    if (got == dtype) return;
  FERRY_THROW(InputError, "input", name, " has dtype ", dtype_name(got), "; expected ", allowed_text);
}

cudaStream_t stream_from(nb::handle stream) {
  if (stream.is_none()) return nullptr;
  nb::handle value = stream;
  nb::object attribute;
  if (!PyLong_Check(stream.ptr())) {
    FERRY_CHECK_INPUT(nb::hasattr(stream, "cuda_stream"), "stream must be None, an int (a cudaStream_t) or an ",
                      "object with a cuda_stream attribute (torch.cuda.Stream), got ", python_type_name(stream));
    attribute = stream.attr("cuda_stream");
    value = attribute;
  }
  return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(nb::cast<uint64_t>(value)));
}

// ---- a Bootstrap implemented in Python ---------------------------------------------------------------------------

// Calls back into a Python object with rank, world, local_rank, local_world attributes and the methods
// allgather(data: bytes) -> list[bytes], broadcast(data: bytes, root: int) -> bytes, barrier(). ferry.init(group=...)
// passes one built over torch.distributed. The GIL is taken for each call (the C++ caller runs without it).
class PythonBootstrap final : public Bootstrap {
 public:
  explicit PythonBootstrap(nb::object impl) : impl_(std::move(impl)) {
    rank_ = nb::cast<int>(impl_.attr("rank"));
    world_ = nb::cast<int>(impl_.attr("world"));
    local_rank_ = nb::cast<int>(impl_.attr("local_rank"));
    local_world_ = nb::cast<int>(impl_.attr("local_world"));
    FERRY_CHECK_AS(BootstrapError, "bootstrap", world_ >= 1 && rank_ >= 0 && rank_ < world_, "Python bootstrap ",
                   python_type_name(impl_), " has rank=", rank_, " world=", world_, "; need 0 <= rank < world");
    FERRY_CHECK_AS(BootstrapError, "bootstrap", local_world_ >= 1 && local_rank_ >= 0 && local_rank_ < local_world_,
                   "Python bootstrap ", python_type_name(impl_), " has local_rank=", local_rank_,
                   " local_world=", local_world_, "; need 0 <= local_rank < local_world");
  }
  ~PythonBootstrap() override {
    // NOTE: the last reference may go away at interpreter shutdown, when no Python call is allowed: leak it then.
#if PY_VERSION_HEX >= 0x030D0000
    bool const finalizing = Py_IsFinalizing();
#else
    bool const finalizing = _Py_IsFinalizing();
#endif
    if (!Py_IsInitialized() || finalizing) {
      impl_.release();
      return;
    }
    nb::gil_scoped_acquire gil;
    impl_.reset();
  }

  int rank() const override {
    return rank_;
  }
  int world() const override {
    return world_;
  }
  int local_rank() const override {
    return local_rank_;
  }
  int local_world() const override {
    return local_world_;
  }

  void allgather(void const* send, void* recv, std::size_t bytes) override {
    FERRY_CHECK_INPUT((send && recv) || bytes == 0, "bootstrap allgather: null buffer for ", bytes, " bytes");
    check_usable();
    nb::gil_scoped_acquire gil;
    // NOTE: copy send first: it may alias recv + rank * bytes.
    nb::bytes const mine(static_cast<char const*>(send), bytes);
    call("allgather", [&] {
      nb::object blocks = impl_.attr("allgather")(mine);
      size_t const count = nb::len(blocks);
      FERRY_CHECK_AS(BootstrapError, "bootstrap", count == static_cast<size_t>(world_), "allgather returned ", count,
                     " blocks for world=", world_);
      for (size_t r = 0; r < count; ++r) {
        nb::bytes const block = nb::cast<nb::bytes>(blocks[r]);
        FERRY_CHECK_AS(BootstrapError, "bootstrap", block.size() == bytes, "allgather: rank ", r, " sent ",
                       block.size(), " bytes, this rank ", bytes, "; every rank must make the same call");
        if (bytes) std::memcpy(static_cast<char*>(recv) + r * bytes, block.c_str(), bytes);
      }
    });
  }

  void broadcast(void* data, std::size_t bytes, int root) override {
    FERRY_CHECK_INPUT(data || bytes == 0, "bootstrap broadcast: null buffer for ", bytes, " bytes");
    FERRY_CHECK_INPUT(root >= 0 && root < world_, "bootstrap broadcast: root=", root, " is outside [0, ", world_, ")");
    check_usable();
    nb::gil_scoped_acquire gil;
    call("broadcast", [&] {
      nb::bytes const mine(static_cast<char const*>(data), bytes);
      nb::bytes const got = nb::cast<nb::bytes>(impl_.attr("broadcast")(mine, root));
      FERRY_CHECK_AS(BootstrapError, "bootstrap", got.size() == bytes, "broadcast from root ", root, ": got ",
                     got.size(), " bytes, expected ", bytes, "; every rank must make the same call");
      if (bytes) std::memcpy(data, got.c_str(), bytes);
    });
  }

  void barrier() override {
    check_usable();
    nb::gil_scoped_acquire gil;
    call("barrier", [&] { impl_.attr("barrier")(); });
  }

 private:
  void check_usable() const {
    FERRY_CHECK_AS(BootstrapError, "bootstrap", failure_.empty(), "the Python bootstrap already failed: ", failure_);
  }

  // Runs one collective; a Python exception (or a malformed answer) becomes BootstrapError, and every later call
  // fails the same way (the ranks are out of step after a failed collective).
  template <typename Body>
  void call(char const* what, Body&& body) {
    try {
      body();
    } catch (nb::python_error& error) {
      failure_ = concat(what, " raised ", error.what());
      FERRY_THROW(BootstrapError, "bootstrap", "the Python bootstrap's ", failure_);
    } catch (nb::cast_error const&) {
      failure_ = concat(what, " returned a value of the wrong type (allgather: list of bytes, broadcast: bytes)");
      FERRY_THROW(BootstrapError, "bootstrap", "the Python bootstrap's ", failure_);
    } catch (BootstrapError const& error) {
      failure_ = error.what();
      throw;
    }
  }

  nb::object impl_;
  int rank_ = 0;
  int world_ = 1;
  int local_rank_ = 0;
  int local_world_ = 1;
  std::string failure_;
};

std::shared_ptr<Communicator> create_communicator(std::unique_ptr<Bootstrap> bootstrap, std::string const& backend,
                                                  int device, std::string const& topology) {
  check_env();  // a FERRY_* value the library refuses is refused here, before any rank waits on this one
  CommunicatorOptions options;
  options.backend = parse_backend(backend);
  options.device = device;
  options.topology = topology;
  nb::gil_scoped_release release;
  return std::shared_ptr<Communicator>(Communicator::create(std::move(bootstrap), options));
}

}  // namespace

// ---- EpBuffer ----------------------------------------------------------------------------------------------------

// What one dispatch returns: views of the EpBuffer's buffers (valid until its next dispatch), None where the call
// filled nothing.
struct PyDispatchResult {
  nb::object recv_x, recv_topk_idx, recv_topk_weights, recv_src, num_recv, expert_counts, expert_x, expert_src_row;
  nb::object recv_scales, recv_token_scales, expert_scales, expert_token_scales;  // quantized delivery
  std::optional<int64_t> num_recv_host;
  int recv_capacity = 0;
  int expert_slots = 0;
  int64_t masked_entries = 0;  // rank masking: this call's entries not sent (their rank is masked)
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

class PyEpBuffer {
 public:
  PyEpBuffer(std::shared_ptr<Communicator> comm, EpConfig const& config)
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

  EpBuffer& buffer() const { return *buffer_; }
  Placement const& placement() const { return placement_; }

  struct Inputs {
    DispatchArgs args;
    Framework framework;
    cudaStream_t stream;
    nb::object x_bytes, scales_bytes;  // uint8 views made of torch fp8 / fp4 inputs, alive for the call
  };

  // Converts and checks dispatch arguments (no C++ call). Pre-quantized input (x_scales given, a quantized
  // dispatch_format): x is the payload, one byte per element (fp8) or two elements per byte (fp4), x_scales the block
  // scales [num_tokens, num_scales], x_token_scales nvfp4's per-token scales. x_scales with bf16, or x_token_scales
  // where it does not belong, go to the C++ call as given: it refuses them with its own message.
  // cached: a cached dispatch (DispatchArgs::handle), which routes by the handle's ids and weights: topk_idx and
  // topk_weights are None there (given ones go to the C++ call as they are, which refuses them).
  Inputs dispatch_inputs(nb::handle x, nb::handle topk_idx, nb::handle topk_weights, nb::handle x_scales,
                         nb::handle x_token_scales, bool expand, bool eager, nb::handle stream,
                         bool return_recv_hook = false, bool cached = false, int x_repeat = 1) const {
    Inputs in;
    in.framework = framework_of(x);
    bool const prequantized = !x_scales.is_none() && format_ != WireFormat::bf16;
    bool const fp8 = format_ == WireFormat::fp8_e4m3 || format_ == WireFormat::fp8_e4m3_ue8m0;
    ArrayArg xa;
    if (prequantized) {
      Frameworks const& f = frameworks();
      in.x_bytes = torch_bytes(x, in.framework, fp8 ? f.torch_fp8_e4m3fn : f.torch_fp4_e2m1fn_x2);
      xa = placement_.import(in.x_bytes, "x", {-1, static_cast<int64_t>(wire_.payload_bytes)}, "num_tokens");
      if (fp8)
        check_dtype(xa.dtype(), "x", {kFp8, kU8, kI8},
                    "float8_e4m3fn or uint8 (pre-quantized x is the fp8 payload: one byte per element)");
      else
        check_dtype(xa.dtype(), "x", {kU8, kI8},
                    "uint8 (pre-quantized x is the e2m1 payload: two elements per byte, element 2i in the low nibble)");
    } else {
      xa = placement_.import(x, "x", {-1, hidden_}, "num_tokens");
      check_dtype(xa.dtype(), "x", {kBf16, kU16}, "bfloat16 (or uint16 holding bf16 bits)");
    }
    // x_repeat (mode='ll'): token i sends row i // x_repeat of x, so x has num_tokens / x_repeat rows
    FERRY_CHECK_INPUT(x_repeat >= 1, "x_repeat=", x_repeat, " must be >= 1 and divide num_tokens");
    int64_t const x_rows = static_cast<int64_t>(xa.shape(0));
    int64_t const num_tokens = x_rows * x_repeat;
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
    if (cached) {
      if (!topk_idx.is_none()) in.args.topk_idx = nonnull(placement_.import_any(topk_idx, "topk_idx").data());
      if (!topk_weights.is_none())
        in.args.topk_weights =
            static_cast<float const*>(nonnull(placement_.import_any(topk_weights, "topk_weights").data()));
    } else {
      FERRY_CHECK_INPUT(!topk_idx.is_none(), "topk_idx is None; dispatch needs the [num_tokens, topk] expert ids ",
                        "(only a cached dispatch, handle=h, routes without them)");
      FERRY_CHECK_INPUT(!topk_weights.is_none(), "topk_weights is None; dispatch needs the [num_tokens, topk] ",
                        "weights (only a cached dispatch, handle=h, routes without them)");
      // entry tokens (x_repeat=r on a topk-1 buffer): the ids and weights may come as [rows of x, r], each token's
      // r entries in a row, the same memory as [num_tokens, 1]
      auto const import_entries = [&](nb::handle array, char const* name) {
        if (x_repeat > 1 && topk_ == 1) {
          ArrayArg a = placement_.import_any(array, name);
          if (a.ndim() == 2 && static_cast<int64_t>(a.shape(0)) == x_rows &&
              static_cast<int64_t>(a.shape(1)) == x_repeat) {
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

  ResultObject dispatch(nb::handle x, nb::handle topk_idx, nb::handle topk_weights, nb::handle x_scales,
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
  nb::tuple dispatch_owned(nb::handle x, nb::handle topk_idx, nb::handle topk_weights, nb::handle x_scales, bool eager,
                           bool save_handle, nb::handle handle, nb::handle stream) {
    nb::object saved = nb::none();
    nb::object device;  // x's torch.device: the outputs' and the handle's
    PyDispatchHandle* save = nullptr;
    PyDispatchHandle* cached = nullptr;
    Inputs in = checked(Leg::dispatch, stream, x, [&] {
      cached = handle_arg(handle, "handle");
      FERRY_CHECK_INPUT(cached == nullptr || !save_handle,
                        "a cached dispatch (handle=) saves no handle; pass "
                        "save_handle=False");
      FERRY_CHECK_INPUT(framework_of(x) == kTorch,
                        "x must be a torch tensor (this call returns torch tensors), "
                        "got ",
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
    // fresh tensors from torch's allocator (on the current stream), filled by one copy_received (one kernel on cuda)
    Owned const owned(device);
    ReceivedCopy to;
    to.rows = static_cast<int>(rows);
    nb::object const recv_x = owned.empty(rows, static_cast<int64_t>(recv_x_spec_.dims[1]), recv_x_spec_.dtype);
    to.recv_x = Owned::data_of(recv_x);
    nb::object recv_scales = nb::none();
    if (quantized_) {
      FERRY_CHECK_INPUT(scale_layout_ == ScaleLayout::row_major, "this call returns row-major recv_scales only");
      recv_scales = owned.empty(rows, wire_.num_scales, wire_.scale_bytes == 4 ? kF32 : kU8);
      to.recv_scales = Owned::data_of(recv_scales);
    }
    nb::object ids = nb::none(), weights = nb::none(), counts = nb::none();
    if (!cached) {
      weights = owned.empty(rows, topk_, kF32);
      to.recv_topk_weights = static_cast<float*>(Owned::data_of(weights));
      bool const idx_int64 = in.args.topk_idx_type == IndexType::int64;
      ids = owned.empty(rows, topk_, idx_int64 ? kI64 : kI32);
      to.recv_topk_idx = Owned::data_of(ids);
      to.recv_topk_idx_type = in.args.topk_idx_type;
      if (eager) {
        nb::list list;
        for (int32_t c : counts_host) list.append(c);
        counts = std::move(list);
      }
    }
    {
      Exclusive const exclusive(*this);
      nb::gil_scoped_release release;
      buffer_->copy_received(to, in.stream);
    }
    nb::object const num_recv = view(views_[kTorch].num_recv, got.num_recv, kTorch, ViewSpec(kI32, {1}));
    return nb::make_tuple(recv_x, recv_scales, ids, weights, counts, saved, num_recv);
  }

  // dispatch_inputs with the handles set: save (save_handle=) and cached (handle=: a cached dispatch).
  Inputs dispatch_inputs_with(nb::handle x, nb::handle topk_idx, nb::handle topk_weights, nb::handle x_scales,
                              nb::handle x_token_scales, bool expand, bool eager, nb::handle stream,
                              bool return_recv_hook, PyDispatchHandle* save, PyDispatchHandle* cached,
                              int x_repeat = 1) const {
    Inputs got = dispatch_inputs(x, topk_idx, topk_weights, x_scales, x_token_scales, expand, eager, stream,
                                 return_recv_hook, cached != nullptr, x_repeat);
    if (save) got.args.save_handle = &save->handle;
    if (cached) got.args.handle = &cached->handle;
    return got;
  }

  // The C++ dispatch of checked inputs; save: the handle it saves into (its num_recv_host is set here).
  DispatchResult run_dispatch(Inputs const& in, PyDispatchHandle* save) {
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
  // NOTE: the completions refuse a bad stream locally, before anything: the hook stays pending (the send half
  // already went out, so there is no exchange left to join as a refusal), and a second call with a good stream
  // completes it. The C++ completions refuse their misuse the same way.
  ResultObject complete_dispatch(nb::handle stream) {
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

  void complete_combine(nb::handle stream) {
    cudaStream_t const s = resolve_stream(stream, last_framework_);
    Exclusive const exclusive(*this);
    nb::gil_scoped_release release;
    buffer_->complete_combine(s);
  }

  struct CombineInputs {
    CombineArgs args;
    cudaStream_t stream;
    nb::object y;
  };

  // Converts and checks combine arguments (no C++ call) for a dispatch of num_tokens tokens (y's rows).
  // num_recv_host: the rows that dispatch received, when known on the host (-1: not known, recv_capacity is read).
  // group, group_weights (mode='ll', topk 1): y gets num_tokens / group rows, the weighted sums of groups of tokens
  // (CombineArgs::group); group_weights [num_tokens / group, group] float32.
  CombineInputs combine_inputs(nb::handle x, std::string const& layout, nb::handle out, bool eager, nb::handle stream,
                               int num_tokens, int64_t num_recv_host, bool return_recv_hook = false, int group = 1,
                               nb::handle group_weights = nb::none()) const {
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
      if (out.is_none()) {
        in.y = allocate_rows(framework, x, y_rows, false, "combine");
      } else {
        in.y = nb::borrow(out);
      }
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

  nb::object combine(nb::handle x, std::string const& layout, nb::handle out, bool eager, bool return_recv_hook,
                     nb::handle handle, nb::handle stream, int group, nb::handle group_weights) {
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

  // A handle for this buffer's layout shape (EpBuffer::make_handle). cuda: its storage is a torch uint8 tensor on
  // this GPU when torch is loaded (the caching allocator, allocated on the current torch stream), else the library's
  // own device memory; cpu: host memory of the handle's own.
  // device: a torch.device of this GPU where the caller has one at hand (a string is parsed per call otherwise)
  PyDispatchHandle make_handle(nb::handle device = nb::handle()) const {
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

  // The backward pass of a dispatch (EpBuffer::dispatch_backward): grad of the rows it delivered (layout 'rank':
  // recv_x [>= num_recv, hidden]; 'expert': expert_x) -> grad_x [num_tokens, hidden] (bf16, or fp32 with fp32).
  nb::object dispatch_backward(nb::handle grad, nb::handle handle, std::string const& layout, nb::handle out, bool fp32,
                               bool eager, nb::handle stream) {
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

  // The backward pass of a combine (EpBuffer::combine_backward): a cached dispatch of grad_y [num_tokens, hidden].
  // Returns (the gradient rows: recv_x for layout 'rank', expert_x for 'expert', views of this buffer valid until its
  // next dispatch; grad_topk_weights [num_tokens, topk] float32 or None).
  nb::tuple combine_backward(nb::handle grad_y, nb::handle handle, std::string const& layout, nb::handle x,
                             std::optional<bool> want_grad_weights, nb::handle grad_topk_weights, bool eager,
                             nb::handle stream) {
    struct BackwardInputs {
      CombineBackwardArgs args;
      cudaStream_t stream = nullptr;
      nb::object grad_w;
      Framework framework = kNumpy;
      int num_tokens = 0;
    };
    // NOTE: an unreadable layout is refused as the default one ('expert'): which exchanges a refusal joins depends on
    // the layout (below), and the peers' calls are meant to be the same call.
    bool const expert_major = layout != "rank";
    BackwardInputs in;
    std::string reason;
    try {
      PyDispatchHandle* const h = required_handle(handle, "combine_backward");
      expert_layout(layout, "combine_backward");
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
    } catch (InputError const& error) {
      reason = error.what();
    }
    if (!reason.empty()) {
      cudaStream_t const s = refusal_stream(stream, grad_y);
      Exclusive const exclusive(*this);
      forget_dispatch();
      nb::gil_scoped_release release;
      refuse_combine_backward(reason, expert_major, s);
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

  // Host seconds of `iters` dispatch + combine pairs run in a C++ loop (arguments converted once): what the same
  // calls cost without Python, for bench_overhead.py.
  double time_cpp_loop(int iters, nb::handle x, nb::handle topk_idx, nb::handle topk_weights, bool expand,
                       nb::handle combine_x, std::string const& layout, nb::handle out, bool eager, nb::handle stream) {
    FERRY_CHECK_INPUT(iters >= 1, "iters=", iters, " must be at least 1");
    Inputs const d = dispatch_inputs(x, topk_idx, topk_weights, nb::none(), nb::none(), expand, eager, stream);
    CombineInputs const c =
        combine_inputs(combine_x, layout, out, eager, stream, d.args.num_tokens, last_num_recv_host_);
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

  int num_local_experts() const { return num_local_; }
  int recv_capacity() const { return capacity_; }
  int expert_slots() const { return slots_; }

 private:
  // NOTE: an EpBuffer belongs to one host thread; with the GIL released two Python threads could enter it at once.
  class Exclusive {
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

  enum class Leg { dispatch, combine };

  // Runs the binding's own argument checks of a call (they return what the C++ call needs). An InputError they
  // raise is this rank's refusal of the call: it joins the call's exchange as a refusal (EpBuffer::refuse_*: every
  // peer's same call fails with InputError naming this rank, so the ranks stay in step) and raises the same message
  // here. stream / like: the call's stream argument and an input whose framework picks the default stream.
  template <typename Checks>
  auto checked(Leg leg, nb::handle stream, nb::handle like, Checks&& checks) -> decltype(checks()) {
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
  cudaStream_t refusal_stream(nb::handle stream, nb::handle like) const {
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

  // What combine refers to, as C++ holds it (EpBuffer: the last dispatch that succeeded on this rank): the tokens of
  // the last dispatch that returned (y's rows), or, after one that raised, none (the C++ combine then refuses).
  void remember_dispatch(int num_tokens, DispatchResult const& got, Framework framework, bool eager) {
    bool const hooked = buffer_->pending_hook() == std::string("dispatch");
    hooked_num_tokens_ = hooked ? num_tokens : -1;
    last_num_tokens_ = hooked ? -1 : num_tokens;  // combined after its completion (C++ refuses a combine before)
    last_num_recv_host_ = got.num_recv_host;
    last_framework_ = framework;
    last_eager_ = eager;
  }
  void forget_dispatch() {
    last_num_tokens_ = -1;
    last_num_recv_host_ = -1;
  }

  cudaStream_t resolve_stream(nb::handle stream, Framework framework) const {
    if (!stream.is_none()) return stream_from(stream);
    // Default: the current torch stream of this GPU for torch CUDA tensors; else the default stream (null).
    if (placement_.backend() == Backend::cuda && framework == kTorch) return torch_current_stream(placement_.device());
    return nullptr;
  }

  // An output [rows, cols] in like's framework and device: bf16 (NumPy: uint16 bits) or float32.
  nb::object allocate(Framework framework, nb::handle like, int64_t rows, int64_t cols, bool fp32,
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
  nb::object allocate_rows(Framework framework, nb::handle like, int64_t rows, bool fp32, char const* call) const {
    return allocate(framework, like, rows, hidden_, fp32, call);
  }

  // ---- handles

  static PyDispatchHandle* handle_arg(nb::handle object, char const* name) {
    if (object.is_none()) return nullptr;
    PyDispatchHandle* handle = nullptr;
    FERRY_CHECK_INPUT(nb::try_cast(object, handle, /*convert=*/false) && handle != nullptr, name,
                      " must be a ferry.DispatchHandle (EpBuffer.make_handle()), got ", python_type_name(object));
    return handle;
  }
  static PyDispatchHandle* required_handle(nb::handle object, char const* call) {
    PyDispatchHandle* const handle = handle_arg(object, "handle");
    FERRY_CHECK_INPUT(handle != nullptr, call, " needs handle, the forward dispatch's DispatchHandle (filled by ",
                      "dispatch(..., save_handle=h))");
    return handle;
  }
  // After a call that made the handle's layout the buffer's current one (EpBuffer: combine with a handle and the
  // backward passes): a later combine without a handle refers to that dispatch.
  void use_handle(PyDispatchHandle const& handle) {
    last_num_tokens_ = handle.handle.num_tokens();
    last_num_recv_host_ = handle.num_recv_host;
  }

  static bool expert_layout(std::string const& layout, char const* call) {
    FERRY_CHECK_INPUT(layout == "expert" || layout == "rank", call, " layout='", layout, "' is not a layout; use ",
                      "'expert' (expert-major rows [num_local_experts, expert_capacity, hidden]) or 'rank' ",
                      "(rank-major rows [num_recv, hidden])");
    return layout == "expert";
  }

  // Gradient rows in a dispatch's layout: expert-major [num_local_experts, expert_capacity, hidden], or rank-major
  // [>= num_recv, hidden] (num_recv_host < 0: recv_capacity rows), bf16.
  ArrayArg grad_rows(nb::handle grad, char const* name, bool expert_major, int64_t num_recv_host,
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

  [[noreturn]] void refuse_combine_backward(std::string const& reason, bool expert_major, cudaStream_t stream) {
    buffer_->refuse_combine_backward(expert_major ? CombineLayout::expert_major : CombineLayout::rank_major, reason,
                                     stream);
  }

  // ---- cached views

  // A torch input of one of the given one-byte float dtypes (None: none) as a uint8 view of the same memory, so that
  // its import does not depend on whether torch's DLPack knows the type; anything else as it is.
  static nb::object torch_bytes(nb::handle object, Framework framework, nb::handle dtype) {
    if (framework == kTorch && !dtype.is_none() && object.attr("dtype").is(dtype))
      return object.attr("view")(frameworks().torch_uint8);
    return nb::borrow(object);
  }

  // The C++ API tells "given" by a non-null pointer; an empty array may have none.
  static void const* nonnull(void const* data) {
    alignas(16) static float const kEmpty[4] = {};
    return data ? data : kEmpty;
  }

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

  // Delivered rows (recv_x, expert_x: `groups` > 0 adds a leading dimension): bf16 [rows, hidden], or the quantized
  // payload, fp8 [rows, hidden] (float8_e4m3fn) or fp4 [rows, hidden / 2] (uint8, two elements per byte).
  ViewSpec row_spec(size_t groups, size_t rows, size_t row_bytes) const {
    nb::dlpack::dtype const dtype = !quantized_                                           ? kBf16
                                    : wire_.payload_bytes == static_cast<size_t>(hidden_) ? kFp8
                                                                                          : kU8;
    size_t const cols = quantized_ ? row_bytes : static_cast<size_t>(hidden_);
    return groups ? ViewSpec(dtype, {groups, rows, cols}) : ViewSpec(dtype, {rows, cols});
  }

  // One scale tensor of `rows` rows in recv_scale_layout (`groups` > 0: that many back to back, a leading dimension),
  // its shape read off scale_tensor_bytes: row_major [rows, num_scales]; mn_major_tma [num_scales, rows_aligned];
  // mn_major_tma_packed_ue8m0 int32 [ceil(num_scales / 4), rows_aligned]; blocked_128x4 uint8 [bytes]. Elements
  // are float32 (fp8's scales) or one byte (uint8).
  ViewSpec scale_spec(size_t groups, int rows) const {
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

  nb::object view(View& slot, void const* data, Framework framework, ViewSpec const& spec) {
    if (data == nullptr) return nb::none();
    if (slot.data != data || !slot.object.is_valid()) {
      nb::dlpack::dtype dtype = spec.dtype;
      if (framework == kNumpy && dtype == kBf16) dtype = kU16;  // NOTE: NumPy has no bfloat16: raw bits
      // NOTE: NumPy has no fp8 (raw bytes); torch gets uint8 made float8_e4m3fn by Tensor.view, which works whether
      // or not its DLPack knows fp8. Other DLPack consumers get DLPack's float8_e4m3fn.
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

  static nb::object head(nb::object const& full, int64_t rows) {
    if (full.is_none()) return full;
    nb::object const slice = nb::steal(PySlice_New(nullptr, nb::int_(rows).ptr(), nullptr));
    PyObject* const part = PyObject_GetItem(full.ptr(), slice.ptr());
    if (!part) throw nb::python_error();
    return nb::steal(part);
  }

  // The first rows of the slot's cached view, itself cached: an eager call of the same row count returns the same
  // slice again (a framework's slice costs as much as the rest of the call), as lazy calls return the same views.
  static nb::object cached_head(View& slot, nb::object const& full, int64_t rows) {
    if (full.is_none()) return full;
    if (slot.head_rows != rows || !slot.head.is_valid() || !slot.head_base.is(full)) {
      slot.head = head(full, rows);
      slot.head_base = full;
      slot.head_rows = rows;
    }
    return slot.head;
  }

  // ---- fresh outputs (dispatch_owned)

  // Fresh torch tensors on like's device (torch's allocator: on cuda its caching allocator, on the current stream),
  // for dispatch_owned to fill.
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

  PyDispatchResult result(DispatchResult const& got, Framework framework, bool eager) {
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
        // NOTE: only the row-major scales have rows as their first dimension; the other layouts stay whole tensors
        // of recv_capacity rows (their strides depend on the row count).
        if (scale_layout_ == ScaleLayout::row_major)
          out.recv_scales = cached_head(v.recv_scales, out.recv_scales, rows);
        out.recv_token_scales = cached_head(v.recv_token_scales, out.recv_token_scales, rows);
      }
    }
    out.recv_capacity = got.recv_capacity;
    out.masked_entries = got.masked_entries;
    out.expert_slots = got.expert_slots;
    return out;
  }

  // The Python object of a result: the last one again when every field is the same (lazy calls return the same
  // cached views each time; a DispatchResult is read-only), else a new one, so that a call creates no object.
  ResultObject result_object(PyDispatchResult&& got) {
    if (last_result_.is_valid()) {
      PyDispatchResult const& last = *nb::inst_ptr<PyDispatchResult>(last_result_);
      if (same_result(last, got)) return nb::borrow<ResultObject>(last_result_);
    }
    last_result_ = nb::cast(std::move(got));
    return nb::borrow<ResultObject>(last_result_);
  }
  static bool same_result(PyDispatchResult const& a, PyDispatchResult const& b) {
    return a.recv_x.is(b.recv_x) && a.recv_topk_idx.is(b.recv_topk_idx) &&
           a.recv_topk_weights.is(b.recv_topk_weights) && a.recv_src.is(b.recv_src) && a.num_recv.is(b.num_recv) &&
           a.expert_counts.is(b.expert_counts) && a.expert_x.is(b.expert_x) && a.expert_src_row.is(b.expert_src_row) &&
           a.recv_scales.is(b.recv_scales) && a.recv_token_scales.is(b.recv_token_scales) &&
           a.expert_scales.is(b.expert_scales) && a.expert_token_scales.is(b.expert_token_scales) &&
           a.num_recv_host == b.num_recv_host && a.recv_capacity == b.recv_capacity &&
           a.expert_slots == b.expert_slots && a.masked_entries == b.masked_entries;
  }

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

namespace {

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
  throw std::runtime_error(message);
}

}  // namespace
}  // namespace ferry::python

NB_MODULE(_ext, m) {
  using namespace ferry;
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

  // ---- errors: the C++ family, same messages. Translators run last-registered first, so subclasses come after Error.
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
  m.def("_raise_for_test", &raise_for_test, "kind"_a, "message"_a,
        "Throws the C++ exception `kind` (tests of the exception translation).");
  m.def("_use_exchange_api", &use_exchange_api, "on"_a,
        "Whether torch tensors and torch's current stream are read through torch's DLPack C exchange API (default) "
        "or its Python-level exports (tests of both ways). Returns whether the loaded torch has the API (False "
        "without torch).");

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

  // ---- communicators
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
        return create_communicator(std::make_unique<PythonBootstrap>(std::move(bootstrap)), backend, device, topology);
      },
      "bootstrap"_a, "backend"_a, "device"_a, "topology"_a = "");

  // ---- EpConfig
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
              "call (docs/internode.md, 'Rank masking'); cpu backend only in this version.")
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

  // ---- dispatch results and EpBuffer
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
              "Rank masking: this call's (token, k) entries of this rank's tokens not sent (their rank is masked).");

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

  nb::class_<PyEpBuffer>(m, "EpBuffer",
                         "Dispatch and combine of one MoE layer's tokens (collective: every rank creates it with the "
                         "same arguments).")
      .def(
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
          "internode_route"_a = internode_route_name(defaults.internode_route),
          "rank_masking"_a = defaults.rank_masking, "wait_stats"_a = defaults.wait_stats)
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
           "save_handle"_a = false, "handle"_a.none() = nb::none(), "stream"_a = nb::none(),
           "A normal-mode dispatch of torch tensors whose rank-major outputs are fresh torch tensors the caller owns "
           "(torch's allocator, on the current stream), valid after later dispatches, filled in one launch: "
           "(recv_x, recv_scales or None, recv_topk_idx (topk_idx's dtype), recv_topk_weights, expert counts as a "
           "list (eager) or None, the DispatchHandle saved into (save_handle=True) or None, num_recv [1] int32 (a "
           "view)). eager: exactly num_recv rows; lazy: recv_capacity rows, those at or past num_recv unspecified. "
           "handle=h: a cached dispatch (no ids or weights; they and the counts come back None). Refusals as "
           "dispatch().")
      .def("complete_dispatch", &PyEpBuffer::complete_dispatch, "stream"_a = nb::none(),
           "The receive half of a dispatch made with return_recv_hook; returns its DispatchResult.")
      .def("complete_combine", &PyEpBuffer::complete_combine, "stream"_a = nb::none(),
           "The receive half of a combine made with return_recv_hook (fills its out).")
      .def_prop_ro(
          "pending_hook", [](PyEpBuffer const& b) { return std::string(b.buffer().pending_hook()); },
          "The leg whose receive half is pending ('dispatch', 'combine', or '' when none).")
      .def(
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

  // ---- the launcher (ferry.launch)
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
