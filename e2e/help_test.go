package e2e

import (
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestDaemonHelp: -h of each daemon exits 0, says what the daemon is, describes every flag in
// words rather than by a kernel parameter's name alone, and gives the values that 0 stands for.
func TestDaemonHelp(t *testing.T) {
	want := map[string][]string{
		"rtrs-serverd": {"the RTRS server daemon", "5 s", "1234"},
		"rtrs-clientd": {"the RTRS client daemon", "30 s", "5 s", "CPUs + 1"},
	}
	// A flag line, then its usage lines indented by a tab.
	flagLine := regexp.MustCompile(`^  -([a-z0-9-]+)`)
	bare := regexp.MustCompile(`^[a-z_]+(: .{0,20})?( \(default .*\))?$`)
	for name, phrases := range want {
		out, err := exec.Command(filepath.Join(binDir, name), "-h").CombinedOutput()
		if err != nil {
			t.Fatalf("%s -h: %v\n%s", name, err, out)
		}
		text := string(out)
		for _, p := range phrases {
			if !strings.Contains(text, p) {
				t.Errorf("%s -h does not say %q:\n%s", name, p, text)
			}
		}
		flags := 0
		lines := strings.Split(text, "\n")
		for i, l := range lines {
			m := flagLine.FindStringSubmatch(l)
			if m == nil {
				continue
			}
			flags++
			if i+1 >= len(lines) || !strings.HasPrefix(lines[i+1], "    \t") {
				t.Errorf("%s -h: -%s has no description", name, m[1])
				continue
			}
			if u := strings.TrimSpace(lines[i+1]); bare.MatchString(u) {
				t.Errorf("%s -h: -%s is described only as %q", name, m[1], u)
			}
		}
		if flags < 15 {
			t.Errorf("%s -h lists %d flags:\n%s", name, flags, text)
		}
	}
}
