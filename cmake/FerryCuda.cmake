# Decides FERRY_HAVE_CUDA and finds NCCL (headers + library of the same version).
set(FERRY_HAVE_CUDA OFF)
if(NOT FERRY_ENABLE_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER)
    find_program(FERRY_NVCC nvcc PATHS /usr/local/cuda/bin ENV CUDA_HOME PATH_SUFFIXES bin)
    if(FERRY_NVCC)
      set(CMAKE_CUDA_COMPILER ${FERRY_NVCC})
    endif()
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_ARCHITECTURES ${FERRY_CUDA_ARCH})
    enable_language(CUDA)
    # NOTE: CMake 3.25 does not know nvcc 13's C++20 dialect flag; teach it (newer CMake knows the same flag).
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(CMAKE_CUDA_EXTENSIONS OFF)
    find_package(CUDAToolkit REQUIRED)
    set(FERRY_HAVE_CUDA ON)
    # NOTE: FERRY_CUDA_FAST_COMPILE is for CI, which compiles every kernel and runs none (no GPU). At nvcc's
    # --Ofast-compile=max each kernel still goes through cudafe, cicc and ptxas (one that does not compile fails there
    # too), with most of their optimisations off: a sixth of the CPU time of a release compile, and a twentieth for
    # the heaviest translation units. A build whose kernels run (tests on a GPU, ferry bench, a wheel) leaves it
    # empty; `ferry --version` and `ferry bench` name the level.
    if(NOT FERRY_CUDA_FAST_COMPILE STREQUAL "")
      if(NOT FERRY_CUDA_FAST_COMPILE MATCHES "^(max|mid|min)$")
        message(FATAL_ERROR "FERRY_CUDA_FAST_COMPILE=${FERRY_CUDA_FAST_COMPILE}: must be max, mid or min (or empty: "
                            "off, the release build)")
      endif()
      execute_process(COMMAND ${CMAKE_CUDA_COMPILER} --help OUTPUT_VARIABLE _nvcc_help ERROR_QUIET)
      if(NOT _nvcc_help MATCHES "--Ofast-compile")
        message(FATAL_ERROR "FERRY_CUDA_FAST_COMPILE needs nvcc's --Ofast-compile, which ${CMAKE_CUDA_COMPILER} "
                            "(${CMAKE_CUDA_COMPILER_VERSION}) does not have; leave it empty")
      endif()
      add_compile_options($<$<COMPILE_LANGUAGE:CUDA>:--Ofast-compile=${FERRY_CUDA_FAST_COMPILE}>)
      message(STATUS "Ferry: kernels compiled with nvcc --Ofast-compile=${FERRY_CUDA_FAST_COMPILE} "
                     "(FERRY_CUDA_FAST_COMPILE; CI only: slow kernels)")
    endif()
  elseif(FERRY_ENABLE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "FERRY_ENABLE_CUDA=ON but no CUDA compiler (nvcc) was found; install the CUDA toolkit or "
                        "configure with -DFERRY_ENABLE_CUDA=OFF")
  endif()
endif()

if(FERRY_HAVE_CUDA)
  # NCCL: FERRY_NCCL_ROOT, else the PyTorch wheel's nvidia/nccl (the libnccl a torch process already loads), else the
  # system. Headers and library must come from the same place: the device structs change inside a minor series.
  set(_nccl_roots)
  if(FERRY_NCCL_ROOT)
    list(APPEND _nccl_roots ${FERRY_NCCL_ROOT})
  else()
    find_package(Python3 COMPONENTS Interpreter QUIET)
    if(Python3_Interpreter_FOUND)
      execute_process(
        COMMAND ${Python3_EXECUTABLE} -c "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])"
        OUTPUT_VARIABLE _wheel_nccl OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _wheel_rc)
      if(_wheel_rc EQUAL 0 AND EXISTS "${_wheel_nccl}/include/nccl.h")
        list(APPEND _nccl_roots ${_wheel_nccl})
      endif()
    endif()
  endif()
  foreach(root IN LISTS _nccl_roots)
    if(EXISTS "${root}/include/nccl.h" AND NOT FERRY_NCCL_INCLUDE_DIR)
      set(FERRY_NCCL_INCLUDE_DIR "${root}/include")
      find_library(FERRY_NCCL_LIBRARY NAMES nccl libnccl.so.2 PATHS "${root}/lib" "${root}/lib64" NO_DEFAULT_PATH)
    endif()
  endforeach()
  if(NOT FERRY_NCCL_INCLUDE_DIR)
    find_path(FERRY_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/include /usr/include)
    find_library(FERRY_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib
                 /usr/lib/x86_64-linux-gnu)
  endif()
  if(NOT FERRY_NCCL_INCLUDE_DIR OR NOT FERRY_NCCL_LIBRARY)
    message(FATAL_ERROR "NCCL 2.28+ not found: set FERRY_NCCL_ROOT to a prefix with include/nccl.h and lib/libnccl.so.2")
  endif()
  # Installed binaries (the CLI, the Python module) find the CUDA runtime and the NCCL they were built against where
  # they were at build time (a torch process that already loaded its libnccl.so.2 uses that one: the communicator
  # checks the version).
  get_filename_component(_nccl_dir "${FERRY_NCCL_LIBRARY}" DIRECTORY)
  set(FERRY_CUDA_INSTALL_RPATH "${CUDAToolkit_LIBRARY_DIR};${_nccl_dir}")
  file(STRINGS "${FERRY_NCCL_INCLUDE_DIR}/nccl.h" _nccl_code REGEX "#define NCCL_VERSION_CODE")
  message(STATUS "Ferry: cuda backend ON (arch ${FERRY_CUDA_ARCH}); NCCL headers ${FERRY_NCCL_INCLUDE_DIR} "
                 "(${_nccl_code}), library ${FERRY_NCCL_LIBRARY}")
else()
  message(STATUS "Ferry: cuda backend OFF (FERRY_ENABLE_CUDA=${FERRY_ENABLE_CUDA}); cpu backend only")
endif()
