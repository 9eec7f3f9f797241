# Two commands for a new user: `make demo` and `make test`. Both run the idempotent set-up first.
SHELL := /bin/bash
BUILD ?= build
JOBS ?= $(shell nproc)
BUILD_TYPE ?= Release
CMAKE_ARGS ?=
CTEST_ARGS ?=

.PHONY: all setup configure build test demo format clean check

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

demo: build
	@scripts/demo.sh $(BUILD)

check: build
	$(BUILD)/colossal check

format:
	@git ls-files '*.cpp' '*.h' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	rm -rf $(BUILD)
