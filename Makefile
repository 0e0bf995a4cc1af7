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

demo:
	@echo "The demo starts both daemons; it comes with the daemons (issue 5)." && exit 1

clean:
	rm -rf $(BIN)
