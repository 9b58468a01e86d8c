// A Bootstrap implemented in Python, and the creation of a communicator over any bootstrap.

#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "binding.hpp"
#include "ferry/env.hpp"

namespace ferry::python {

using detail::concat;

namespace {

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

}  // namespace

std::unique_ptr<Bootstrap> make_python_bootstrap(nb::object impl) {
  return std::make_unique<PythonBootstrap>(std::move(impl));
}

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

}  // namespace ferry::python
