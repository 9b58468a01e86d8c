# Two commands work on a fresh clone: `make test` and `make bench`. Both install what they need (once), configure,
# build incrementally and run. BUILD, CMAKE_ARGS and BENCH_ARGS can be overridden.
BUILD ?= build
CMAKE_ARGS ?=
BENCH_ARGS ?= --check --routing random,ring,grouped,hot
SANITIZE_BUILD ?= build-sanitize
TSAN_BUILD ?= build-tsan
JOBS ?= $(shell nproc)
GENERATOR := $(shell command -v ninja >/dev/null 2>&1 && echo Ninja || echo "Unix Makefiles")

.PHONY: all deps configure build test test-unit test-gpu test-kills test-wide test-sanitize test-tsan wheel-check bench format clean

all: build

deps:
	@scripts/install-deps.sh

$(BUILD)/CMakeCache.txt:
	@scripts/install-deps.sh
	cmake -S . -B $(BUILD) -G "$(GENERATOR)" $(CMAKE_ARGS)

configure: $(BUILD)/CMakeCache.txt

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# Every test this machine can run: host unit tests always; GPU tests run (or skip with a message) by themselves; then
# the Python tests (scripts/python-tests.sh: a virtual environment in $(BUILD)/venv), beside ctest
# (scripts/run-tests.sh); the last lines say what was skipped in both and why (from the two junit files). The Python
# environment is prepared before the build (torch, a download of about 3 GB, installs in the background meanwhile),
# so that the build compiles the Python module with the rest.
test: configure
	@scripts/python-tests.sh --prepare $(BUILD)
	cmake --build $(BUILD) -j $(JOBS)
	@scripts/run-tests.sh $(BUILD) $(JOBS)

test-unit: build
	cd $(BUILD) && ctest --output-on-failure -L unit -j $(JOBS)

test-gpu: build
	cd $(BUILD) && ctest --output-on-failure -L gpu

# Rank masking under kills (docs/errors.md, "A rank killed while masking is on"): KILLS times, one rank of four is
# SIGKILLed at a random moment of a loop of low-latency calls on the cpu backend (one node, and 2x2 on both routes; hook
# on and off); every survivor must get each call exact for the ranks in it, or a TimeoutError with the rank masked,
# and then 10 more exact calls. Prints the seed (FERRY_TEST_SEED=... replays it), each kill and a summary; about
# 3 s per kill with KILLS_TIMEOUT_S=2. `make test` runs 3 of them (RankMaskingKills.SurvivorsGoOn).
KILLS ?= 200
KILLS_TIMEOUT_S ?= 2
test-kills: configure
	cmake --build $(BUILD) -j $(JOBS) --target ferry_unit_tests
	FERRY_TEST_KILLS=$(KILLS) FERRY_TEST_KILLS_TIMEOUT_S=$(KILLS_TIMEOUT_S) \
	  $(BUILD)/tests/ferry_unit_tests --gtest_filter='RankMaskingKills.*'

# Wide EP on the cpu backend (tests/wide/test_wide_cpu.cpp): every row of both modes, every wire format and rank
# masking past rank 32 at 64 and 128 ranks by default (emulated nodes of 8, ranks as threads; about 30 s on 2 cores),
# so not part of `make test`. WIDE_TOPOLOGIES=128x8 is the 1024-rank run of docs/internode.md.
WIDE_TOPOLOGIES ?= 8x8,16x8
test-wide: build
	FERRY_WIDE_TOPOLOGIES=$(WIDE_TOPOLOGIES) $(BUILD)/tests/ferry_wide_tests

# The host code and the unit tests under AddressSanitizer (leaks included) and UndefinedBehaviorSanitizer, in a build
# of their own without the cuda backend; any report fails its test. Then the Python tests against that build's module
# (the runtimes preloaded into pytest and its ranks; leaks not checked: the interpreter's own would fill the report).
# About 12 minutes on 2 cores, so not part of `make test` (CI). Install.* is left out: its consumer project links
# without the sanitizers' runtimes.
test-sanitize:
	@scripts/install-deps.sh
	cmake -S . -B $(SANITIZE_BUILD) -G "$(GENERATOR)" -DFERRY_ENABLE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  "-DCMAKE_CXX_FLAGS=-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" \
	  "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined"
	cmake --build $(SANITIZE_BUILD) -j $(JOBS)
	cd $(SANITIZE_BUILD) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest -L unit -E '^Install\.' --output-on-failure --timeout 600 -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 FERRY_VENV=$(abspath $(BUILD))/venv \
	  FERRY_PYTEST_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	  scripts/python-tests.sh $(SANITIZE_BUILD)

# The same unit tests under ThreadSanitizer, in a build of their own (any report fails its test). Ranks that are
# threads share one mapping of each segment (the cpu communicator's ProcessMappings), so a race between ranks is
# seen; ranks that are processes (ferry.launch, the Python tests) are not covered. About 6 minutes on 2 cores.
# Install.* and Build.* are left out: their consumer and header checks link or compile without the runtime.
test-tsan:
	@scripts/install-deps.sh
	cmake -S . -B $(TSAN_BUILD) -G "$(GENERATOR)" -DFERRY_ENABLE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  "-DCMAKE_CXX_FLAGS=-fsanitize=thread -fno-omit-frame-pointer" "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread" \
	  "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread"
	cmake --build $(TSAN_BUILD) -j $(JOBS)
	cd $(TSAN_BUILD) && TSAN_OPTIONS=second_deadlock_stack=1 \
	  ctest -L unit -E '^(Install|Build)\.' --output-on-failure --timeout 1800 -j $(JOBS)

# The Python wheel as pip builds it (cpu backend only, so a few minutes; WHEEL_ARGS for other -C options), then
# scripts/check-wheel.py: its file list (the package, the module, the ferry CLI as a script, the licence), its
# metadata, and, installed into a scratch environment, `ferry --version` and `import ferry`. Not part of `make test`
# (it compiles the library again); CI checks the same install rules in seconds (ctest Install.PythonWheelLayout).
WHEEL_ARGS ?= -C cmake.define.FERRY_ENABLE_CUDA=OFF
wheel-check:
	rm -rf $(BUILD)/wheel
	python3 -m pip wheel --no-deps --disable-pip-version-check -w $(BUILD)/wheel $(WHEEL_ARGS) .
	python3 scripts/check-wheel.py --wheel $$(ls $(BUILD)/wheel/ferry-*.whl)

# ferry bench on every local GPU, or on 4 cpu ranks (with a notice) when there is none.
bench: build
	$(BUILD)/ferry bench $(BENCH_ARGS)

format:
	@git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	rm -rf $(BUILD)
