// Package size parses the sizes the project's tools take on their command lines.
package size

import (
	"fmt"
	"strconv"
	"strings"
)

// Parse reads a positive byte count with an optional K, M or G suffix (powers of 1024).
func Parse(s string) (int, error) {
	mult := 1
	num := s
	switch {
	case strings.HasSuffix(s, "K"):
		mult, num = 1<<10, strings.TrimSuffix(s, "K")
	case strings.HasSuffix(s, "M"):
		mult, num = 1<<20, strings.TrimSuffix(s, "M")
	case strings.HasSuffix(s, "G"):
		mult, num = 1<<30, strings.TrimSuffix(s, "G")
	}
	n, err := strconv.Atoi(num)
	if err != nil || n <= 0 || n > (1<<40)/mult {
		return 0, fmt.Errorf("bad size %q (a positive number, optionally with K, M or G)", s)
	}
	return n * mult, nil
}

// ParseThreshold reads a size as Parse does, or "off" (returned as -1).
func ParseThreshold(s string) (int, error) {
	if s == "off" {
		return -1, nil
	}
	n, err := Parse(s)
	if err != nil {
		return 0, fmt.Errorf("%w, or off", err)
	}
	return n, nil
}
