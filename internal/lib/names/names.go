// Package names holds the one set of rules for the names users and peers hand us: session
// names, device paths, and the tree entries made of them. The transport checks a peer's
// session name with it, the control layer every name written to a control file, and the
// trees every entry they show.
package names

import (
	"fmt"
	"syscall"
	"unicode"
	"unicode/utf8"
)

// Max is the kernel's NAME_MAX: the longest file name, and the size of RTRS's and RNBD's name
// fields (a session name and a device path fill at most Max-1 bytes of them, NUL included).
const Max = 255

// Text refuses what must not be in a name that reaches a config file, a tree or a log:
// invalid UTF-8, whitespace, control characters, and '#' (the config files' comment mark,
// which would cut the name short when the file is read back). The kernel takes all of them;
// its names never go through a text file. Errors wrap EINVAL.
func Text(s string) error {
	if !utf8.ValidString(s) {
		return fmt.Errorf("name %q is not UTF-8: %w", s, syscall.EINVAL)
	}
	for _, r := range s {
		if r == '#' || unicode.IsSpace(r) || unicode.IsControl(r) {
			return fmt.Errorf("name %q contains %q: %w", s, r, syscall.EINVAL)
		}
	}
	return nil
}

// Component checks a name that becomes one entry of a tree (a session's directory, a device's
// file): 1..Max bytes, neither "." nor "..", no '/' and Text. Errors wrap EINVAL.
func Component(name string) error {
	switch {
	case name == "" || len(name) > Max:
		return fmt.Errorf("name of %d bytes: %w", len(name), syscall.EINVAL)
	case name == "." || name == "..":
		return fmt.Errorf("name %q: %w", name, syscall.EINVAL)
	}
	for i := 0; i < len(name); i++ {
		if name[i] == '/' {
			return fmt.Errorf("name %q contains '/': %w", name, syscall.EINVAL)
		}
	}
	return Text(name)
}

// Session checks a session name as the kernel's RTRS does (1..Max-1 bytes, no '/' or '.')
// and with Text. Errors wrap EINVAL.
func Session(name string) error {
	if name == "" || len(name) >= Max {
		return fmt.Errorf("session name of %d bytes: %w", len(name), syscall.EINVAL)
	}
	for i := 0; i < len(name); i++ {
		if name[i] == '/' || name[i] == '.' {
			return fmt.Errorf("session name %q contains %q: %w", name, name[i], syscall.EINVAL)
		}
	}
	return Text(name)
}

// DevicePath checks a device path as RNBD carries it: 1..Max-1 bytes and Text (the server
// resolves it under its search path, which keeps it from escaping). Errors wrap EINVAL.
func DevicePath(p string) error {
	if p == "" || len(p) >= Max {
		return fmt.Errorf("device path of %d bytes: %w", len(p), syscall.EINVAL)
	}
	return Text(p)
}
