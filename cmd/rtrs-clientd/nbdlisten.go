package main

import (
	"crypto/tls"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
)

// listenUnix listens on a unix socket at path that has mode 0600, or 0660 with group gid
// (gid < 0: none), whatever the umask: the socket is made in a private directory, given
// its mode there, and moved into place.
func listenUnix(path string, gid int) (net.Listener, error) {
	tmp, err := os.MkdirTemp(filepath.Dir(path), ".nbd-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	p := filepath.Join(tmp, "s")
	ln, err := net.Listen("unix", p)
	if err != nil {
		return nil, err
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	mode := os.FileMode(0o600)
	if gid >= 0 {
		mode = 0o660
		if err := os.Chown(p, -1, gid); err != nil {
			ln.Close()
			return nil, err
		}
	}
	if err := os.Chmod(p, mode); err != nil {
		ln.Close()
		return nil, err
	}
	_ = os.Remove(path)
	if err := os.Rename(p, path); err != nil {
		ln.Close()
		return nil, err
	}
	return ln, nil
}

// lookupGroup returns the id of group name (a name or a number; "" is -1: none).
func lookupGroup(name string) (int, error) {
	if name == "" {
		return -1, nil
	}
	if n, err := strconv.Atoi(name); err == nil && n >= 0 {
		return n, nil
	}
	g, err := user.LookupGroup(name)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(g.Gid)
}

// checkNBDTCP refuses to serve NBD in clear on anything but loopback: NBD has no
// authentication of its own, and the data would cross the network unprotected.
func checkNBDTCP(addr string, cfg *tls.Config) error {
	if cfg != nil {
		return nil
	}
	ap, err := netip.ParseAddrPort(addr)
	if err == nil && ap.Addr().Unmap().IsLoopback() {
		return nil
	}
	host, _, herr := net.SplitHostPort(addr)
	if herr == nil && host == "localhost" {
		return nil
	}
	return fmt.Errorf("-nbd-tcp %s: NBD over TCP beyond loopback needs TLS (-nbd-tls-cert, -nbd-tls-key, -nbd-tls-ca)", addr)
}
