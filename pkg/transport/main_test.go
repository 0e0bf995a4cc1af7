package transport

import (
	"testing"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"
)

func TestMain(m *testing.M) { testutil.Main(m) }
