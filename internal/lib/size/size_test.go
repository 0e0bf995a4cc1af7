package size

import "testing"

func TestParse(t *testing.T) {
	for in, want := range map[string]int{"64": 64, "4K": 4096, "128K": 131072, "1M": 1 << 20, "2G": 2 << 30} {
		if got, err := Parse(in); err != nil || got != want {
			t.Errorf("%q: %d %v", in, got, err)
		}
	}
	for _, in := range []string{"", "K", "-1", "0", "1.5M", "4k", "1T", "99999999999G"} {
		if _, err := Parse(in); err == nil {
			t.Errorf("%q accepted", in)
		}
	}
}

func TestParseThreshold(t *testing.T) {
	if n, err := ParseThreshold("off"); err != nil || n != -1 {
		t.Errorf("off: %d %v", n, err)
	}
	if n, err := ParseThreshold("64K"); err != nil || n != 64<<10 {
		t.Errorf("64K: %d %v", n, err)
	}
	for _, in := range []string{"", "0", "Off", "-1"} {
		if _, err := ParseThreshold(in); err == nil {
			t.Errorf("%q accepted", in)
		}
	}
}
