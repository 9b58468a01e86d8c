// The binding's view of frameworks (torch, NumPy, any DLPack producer) and the import and checks of array arguments.
#include <cstring>
#include <string>

#include "binding.hpp"

namespace ferry::python {

using detail::concat;

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

namespace {

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

}  // namespace

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

bool use_exchange_api(bool on) {
  Frameworks& f = frameworks();
  if (!torch_tensor_type()) return false;
  f.torch_exchange = on ? f.torch_exchange_found : nullptr;
  return f.torch_exchange_found != nullptr;
}

bool torch_dltensor(nb::handle object, nb::dlpack::dltensor& out) {
  PyTypeObject* const torch = torch_tensor_type();
  DlpackExchangeApi const* const api = frameworks().torch_exchange;
  if (!api || !PyType_IsSubtype(Py_TYPE(object.ptr()), torch)) return false;
  if (api->dltensor_from_py_object_no_sync(object.ptr(), &out) == 0) return true;
  PyErr_Clear();
  return false;
}

namespace {

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

std::string device_text(int device_type, int device_id) {
  if (device_type == nb::device::cpu::value) return "cpu";
  if (device_type == nb::device::cuda_host::value) return "cuda_host";
  if (device_type == nb::device::cuda::value) return concat("cuda:", device_id);
  return concat("DLPack device type ", device_type);
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

Framework framework_of(nb::handle array) {
  PyTypeObject* const type = Py_TYPE(array.ptr());
  if (PyTypeObject* torch = torch_tensor_type(); torch && PyType_IsSubtype(type, torch)) return kTorch;
  if (PyType_IsSubtype(type, numpy_ndarray_type())) return kNumpy;
  return kDlpack;
}

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

std::string shape_text(ArrayArg const& array) {
  std::string out = "[";
  for (size_t i = 0; i < array.ndim(); ++i) out += concat(i ? ", " : "", array.shape(i));
  return out + "]";
}

bool is_c_contiguous(ArrayArg const& array) {
  if (array.size() == 0) return true;
  int64_t expected = 1;
  for (size_t i = array.ndim(); i-- > 0;) {
    if (array.shape(i) != 1 && array.stride(i) != expected) return false;
    expected *= static_cast<int64_t>(array.shape(i));
  }
  return true;
}

// ---- placement -----------------------------------------------------------------------------------------------------

namespace {

// nanobind's import of `object` (a torch tensor through its DLPack capsule) into `out`; false if it is no array.
template <typename Array>
bool import_ndarray(nb::handle object, ArrayArg& out) {
  Array array;
  nb::object const capsule = torch_capsule(object);
  bool const imported = (capsule.is_valid() && nb::try_cast(capsule, array, /*convert=*/false)) ||
                        nb::try_cast(object, array, /*convert=*/false);
  if (imported) out = ArrayArg(array);
  return imported;
}

}  // namespace

int Placement::dlpack_device_type() const {
  return backend_ == Backend::cuda ? nb::device::cuda::value : nb::device::cpu::value;
}

int Placement::dlpack_device_id() const {
  return backend_ == Backend::cuda ? device_ : 0;
}

ArrayArg Placement::import(nb::handle object, char const* name, std::initializer_list<int64_t> dims,
                           char const* free_name, Access access) const {
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

ArrayArg Placement::import_any(nb::handle object, char const* name, Access access) const {
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

}  // namespace ferry::python
