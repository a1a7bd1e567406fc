# Thin wrapper over CMake. `make demo` and `make test` are the README's quick start.
BUILD ?= build
BLAS ?= OPENBLAS
CMAKE_FLAGS ?=
JOBS ?= $(shell nproc)

.PHONY: all deps test-deps build test demo asan fuzz install clean

all: build

deps:
	@sh scripts/install-deps.sh

build: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DKILN_BLAS=$(BLAS) $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

# The server's end-to-end tests also want curl, Chromium and the openai package.
test-deps:
	@sh scripts/install-test-deps.sh build

test: build test-deps
	@ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

# Installs the libraries, headers, pkg-config files and CMake package under PREFIX.
PREFIX ?= /usr/local
install: build
	@cmake --install $(BUILD) --prefix $(PREFIX)

# Trains a small GPT on the King James Bible for a few minutes, then samples from it.
demo: build
	@sh scripts/demo.sh $(BUILD)

# The tests again, built with AddressSanitizer and UndefinedBehaviorSanitizer.
asan: deps test-deps
	@cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DKILN_SANITIZE=ON -DKILN_BLAS=$(BLAS) >/dev/null
	@cmake --build build-asan -j $(JOBS)
	@ctest --test-dir build-asan --output-on-failure -j $(JOBS)

# Bounded libFuzzer runs over the parsers of outside input (FUZZ_SECONDS each, default 120).
fuzz:
	@sh scripts/fuzz.sh

clean:
	rm -rf $(BUILD) build-asan
