# Two commands for a new user: `make demo` and `make test`. Both run the idempotent set-up first.
SHELL := /bin/bash
BUILD ?= build
JOBS ?= $(shell nproc)
BUILD_TYPE ?= Release
CMAKE_ARGS ?=
CTEST_ARGS ?=

.PHONY: all setup configure build test test-asan demo format format-check clean check

all: build

setup:
	@scripts/setup.sh

configure: setup
	@if [ ! -f $(BUILD)/build.ninja ]; then \
	  cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_ARGS); \
	fi

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 1200 $(CTEST_ARGS)
	@$(MAKE) --no-print-directory test-asan
	@$(MAKE) --no-print-directory format-check

# The parsers of untrusted input (JSON, TOML, options, safetensors headers, token files, document
# indexes and loss masks) again
# under AddressSanitizer + UndefinedBehaviorSanitizer. (LibTorch itself is not instrumented;
# its exit-time allocations are not ours, so leak checking is off.) The sanitizer build compiles
# only what those tests link (core, io, dist, data), without CUDA sources: it is part of CI's time.
ASAN_BUILD ?= build-asan
ASAN_TESTS := core/test_json core/test_options core/test_toml checkpoint/test_safetensors data/test_data data/test_documents
test-asan: setup
	@if [ ! -f $(ASAN_BUILD)/build.ninja ]; then \
	  cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DCOLOSSAL_SANITIZE=address,undefined -DCOLOSSAL_CUDA=OFF -DCOLOSSAL_HEADER_CHECK=OFF $(CMAKE_ARGS); \
	fi
	cmake --build $(ASAN_BUILD) -j $(JOBS) --target $(notdir $(ASAN_TESTS))
	@set -e; for t in $(ASAN_TESTS); do \
	  echo "== sanitizers: $$t"; \
	  ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 $(ASAN_BUILD)/tests/$$t --gtest_brief=1; \
	done
	@echo "sanitizer tests: $(words $(ASAN_TESTS)) passed, 0 failed"

demo: build
	@scripts/demo.sh $(BUILD)

check: build
	$(BUILD)/colossal check

# The C++/CUDA sources git tracks, the set `format` rewrites and `format-check` checks.
FORMAT_FILES = git ls-files -z '*.cpp' '*.h' '*.cu' '*.cuh'

format:
	@$(FORMAT_FILES) | xargs -0 clang-format -i

# Fails (listing each offending line) when a tracked source differs from what `make format`
# would write: .clang-format is enforced, not advisory. Part of `make test` (so of CI); about
# 2 s. Same clang-format major version as CI (14) or the output may differ.
format-check:
	@$(FORMAT_FILES) | xargs -0 clang-format --dry-run -Werror
	@echo "format-check: $$($(FORMAT_FILES) | tr -cd '\0' | wc -c) files formatted as .clang-format says"

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)
