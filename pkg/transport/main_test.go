package transport

import (
	"os"
	"testing"

	"github.com/rtrs-go/rtrs/pkg/log"
)

func TestMain(m *testing.M) {
	// Path up/down messages are expected in these tests; warnings and errors still show.
	if _, err := log.Setup(log.Options{Level: "warning"}); err != nil {
		panic(err)
	}
	os.Exit(m.Run())
}
