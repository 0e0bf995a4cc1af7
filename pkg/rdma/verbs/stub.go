//go:build !verbs

// Package verbs is the pkg/rdma provider over rdma-core. This build has no verbs (it was
// built without the verbs tag): New reports that, and the soft provider serves.
package verbs

import (
	"fmt"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// Built reports whether this binary has the verbs provider (built with the verbs tag).
const Built = false

// New fails: this binary was built without rdma-core.
func New() (rdma.Provider, error) {
	return nil, fmt.Errorf("verbs: this binary was built without the verbs provider (make build with rdma-core's development packages, or go build -tags verbs): %w", rdma.ErrNoDevice)
}
