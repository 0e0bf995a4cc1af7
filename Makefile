GO ?= go
BIN := bin

.PHONY: build test vet bench demo deb clean

# The verbs provider (pkg/rdma/verbs) is built in when rdma-core's development files are
# there (Debian: libibverbs-dev librdmacm-dev); without them the binaries have soft only.
TAGS ?= $(shell test -f /usr/include/infiniband/verbs.h -a -f /usr/include/rdma/rdma_cma.h && echo verbs)

# The version -version prints: scripts/version.sh's, from git describe (none outside git).
VERSION ?= $(shell scripts/version.sh 2>/dev/null)

build:
	$(GO) build -tags '$(TAGS)' $(if $(VERSION),-ldflags '-X github.com/rtrs-go/rtrs/internal/daemon.version=$(VERSION)') -o $(BIN)/ ./cmd/...

test:
	scripts/test.sh

vet:
	gofmt -l . | (! grep .) && $(GO) vet ./...

# Benchmarks with same-run baselines; raw runs go to bench/results/, figures to docs/benchmarks.md.
bench: build
	scripts/bench.sh

# Both daemons on this machine: a 1 GiB tmpfs export mapped over two loopback paths.
demo:
	scripts/demo.sh

# Debian packages rtrs-serverd and rtrs-clientd (amd64, verbs built in) into dist/.
deb:
	scripts/deb/build.sh dist

clean:
	rm -rf $(BIN) dist
