GO ?= go
BIN := bin

.PHONY: build test vet bench demo clean

build:
	$(GO) build -o $(BIN)/ ./cmd/...

test:
	scripts/test.sh

vet:
	gofmt -l . | (! grep .) && $(GO) vet ./...

# Benchmarks with same-run baselines; figures go to docs/benchmarks.md.
bench: build
	scripts/bench.sh

# Both daemons on this machine: a 1 GiB tmpfs export mapped over two loopback paths.
demo:
	scripts/demo.sh

clean:
	rm -rf $(BIN)
