package daemon

import (
	"errors"
	"runtime/debug"
)

// version is the release this binary was built as, set by the build
// (-ldflags "-X github.com/rtrs-go/rtrs/internal/daemon.version=…", scripts/version.sh):
// the Debian packages' version, so that -version and dpkg agree.
var version string

// ErrVersion is what Load returns after -version printed the version: the daemon exits 0.
var ErrVersion = errors.New("version printed")

// Version is the build's version: the one the build set, else the one Go stamped from the
// checkout (a pseudo-version such as v0.0.0-20261124222559-7b7e44b0abcd), else "devel".
func Version() string {
	if version != "" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "devel"
}
