package atomicfile

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

func TestWrite(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f.conf")
	if err := os.WriteFile(p, []byte("old\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := Write(p, []byte("new\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil || string(b) != "new\n" {
		t.Fatalf("%q, %v", b, err)
	}
	if st, _ := os.Stat(p); st.Mode().Perm() != 0o644 {
		t.Errorf("mode %v", st.Mode())
	}
	// A failed write leaves the old file and no temporary one.
	if err := Write(filepath.Join(dir, "missing", "g"), []byte("x"), 0o644); err == nil {
		t.Error("write into a missing directory taken")
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Errorf("left in the directory: %v", ents)
	}
}

// TestReplace: a symlinked file is replaced where the link leads (the link stays a link),
// and keeps its mode and owner; a new file gets the mode given.
func TestReplace(t *testing.T) {
	dir := t.TempDir()
	real := filepath.Join(dir, "managed", "real.conf")
	if err := os.MkdirAll(filepath.Dir(real), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(real, []byte("old\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	owner := os.Geteuid() == 0 // only root can give a file away
	if owner {
		if err := os.Chown(real, 65534, 65534); err != nil {
			t.Fatal(err)
		}
	}
	link := filepath.Join(dir, "link.conf")
	if err := os.Symlink(real, link); err != nil {
		t.Fatal(err)
	}
	if err := Replace(link, []byte("new\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Lstat(link); err != nil || st.Mode()&os.ModeSymlink == 0 {
		t.Fatalf("the link became %v (%v)", st.Mode(), err)
	}
	b, err := os.ReadFile(real)
	if err != nil || string(b) != "new\n" {
		t.Fatalf("the link's target: %q %v", b, err)
	}
	st, err := os.Stat(real)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v (%v), want 0600 kept", st.Mode(), err)
	}
	if s := st.Sys().(*syscall.Stat_t); owner && (s.Uid != 65534 || s.Gid != 65534) {
		t.Fatalf("owner %d:%d, want 65534:65534 kept", s.Uid, s.Gid)
	}
	fresh := filepath.Join(dir, "fresh.conf")
	if err := Replace(fresh, []byte("x\n"), 0o640); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(fresh); err != nil || st.Mode().Perm() != 0o640 {
		t.Fatalf("a new file's mode %v (%v)", st.Mode(), err)
	}
}
