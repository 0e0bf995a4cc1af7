package main

import (
	"context"
	"crypto/tls"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/rtrs-go/rtrs/internal/daemon"
)

// The NBD socket gets its mode whatever the umask: 0600, or 0660 with the group given.
func TestNBDSocketMode(t *testing.T) {
	old := syscall.Umask(0)
	defer syscall.Umask(old)
	dir := t.TempDir()
	for _, tc := range []struct {
		gid  int
		mode os.FileMode
	}{{-1, 0o600}, {os.Getgid(), 0o660}} {
		sock := filepath.Join(dir, "nbd.sock")
		ln, err := listenUnix(sock, tc.gid)
		if err != nil {
			t.Fatal(err)
		}
		st, err := os.Stat(sock)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode()&os.ModeSocket == 0 || st.Mode().Perm() != tc.mode {
			t.Fatalf("socket %v, want mode %v", st.Mode(), tc.mode)
		}
		if tc.gid >= 0 && int(st.Sys().(*syscall.Stat_t).Gid) != tc.gid {
			t.Fatalf("socket group %d, want %d", st.Sys().(*syscall.Stat_t).Gid, tc.gid)
		}
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
		ln.Close()
		_ = os.Remove(sock)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Fatalf("left behind: %v", entries)
	}
}

// NBD over TCP in clear is refused beyond loopback, at startup.
func TestNBDTCPNeedsTLS(t *testing.T) {
	for _, a := range []string{"0.0.0.0:10809", "[::]:10809", "10.1.2.3:10809", ":10809"} {
		if checkNBDTCP(a, nil) == nil {
			t.Errorf("NBD in clear on %s accepted", a)
		}
		if err := checkNBDTCP(a, &tls.Config{}); err != nil {
			t.Errorf("NBD with TLS on %s: %v", a, err)
		}
	}
	for _, a := range []string{"127.0.0.1:10809", "[::1]:10809", "localhost:10809"} {
		if err := checkNBDTCP(a, nil); err != nil {
			t.Errorf("loopback %s: %v", a, err)
		}
	}
	dir := t.TempDir()
	err := run(context.Background(), []string{"-config", "/dev/null", "-mount", dir + "/a", "-dev-mount", dir + "/b",
		"-nbd-socket", "", "-nbd-tcp", "0.0.0.0:0"})
	if err == nil || !strings.Contains(err.Error(), "TLS") {
		t.Fatalf("daemon with NBD in clear on 0.0.0.0: %v", err)
	}
	if _, err := daemon.TLSConfig("nbd-tls", "cert.pem", "", ""); err == nil || !strings.Contains(err.Error(), "-nbd-tls-key") {
		t.Fatalf("a certificate without key and CA: %v", err)
	}
}
