package transport

import (
	"fmt"
	"syscall"
	"unicode"
	"unicode/utf8"
)

// CheckText refuses what must not be in a name that reaches a config file, a tree or a log:
// invalid UTF-8, whitespace, control characters, and '#' (the config files' comment mark,
// which would cut the name short when the file is read back). The kernel takes all of them;
// its names never go through a text file.
func CheckText(s string) error {
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

// validName checks a session name as the kernel does (no '/' or '.', 1..254 bytes) and with
// CheckText.
func validName(name string) error {
	if name == "" || len(name) >= NameMax {
		return fmt.Errorf("%w: %d bytes", ErrInvalName, len(name))
	}
	if err := CheckText(name); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalName, err)
	}
	for i := 0; i < len(name); i++ {
		if name[i] == '/' || name[i] == '.' {
			return fmt.Errorf("%w: %q contains %q", ErrInvalName, name, name[i])
		}
	}
	return nil
}
