package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"
)

// TestDaemonsSecured runs both daemons as docs/security.md sets them up: mutual TLS between
// them, the client's certificate subject allowlisted, an export ACL. The client maps what the
// ACL gives it and verified IO passes over TLS; modes the ACL does not give it (rw, migration)
// and a device path with '#' are refused through the control file without reaching the
// config; the NBD socket is 0600.
func TestDaemonsSecured(t *testing.T) {
	requireTools(t, "fio")
	dir := t.TempDir()
	pki := testutil.NewPKI(t, "e2e-ca")
	caFile := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(caFile, pki.PEM, 0o600); err != nil {
		t.Fatal(err)
	}
	srvCert, srvKey := testutil.WriteFiles(t, dir, "server", pki.Issue(t, "storage-1", true, "10.77.1.2", "10.77.2.2"))
	cliCert, cliKey := testutil.WriteFiles(t, dir, "client", pki.Issue(t, "compute-1", false))
	acl := filepath.Join(dir, "exports.acl")
	if err := os.WriteFile(acl, []byte("disk subject=CN=compute-1 ro,rw\nother * ro\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := startClusterWith(t,
		[]string{"-provider=soft", "-tls-cert=" + srvCert, "-tls-key=" + srvKey, "-tls-ca=" + caFile, "-allow-subject=CN=compute-1", "-acl=" + acl},
		[]string{"-provider=soft", "-tls-cert=" + cliCert, "-tls-key=" + cliKey, "-tls-ca=" + caFile})
	if err := os.WriteFile(filepath.Join(c.exports, "other"), make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	c.openSession(t, "")
	// The ACL gives disk rw only to the subject CN=compute-1: the map working shows the
	// server knew the client by its certificate.
	dev := c.mapDisk(t)
	if out, err := fioVerify(t, dev, "16M"); err != nil {
		t.Fatalf("fio verify over TLS: %v\n%s", err, out)
	}
	for _, tc := range []struct{ line, want string }{
		{"sessname=e2e device_path=other access_mode=rw", "Permission denied"},
		{"sessname=e2e device_path=other access_mode=migration", "Permission denied"},
		{"sessname=e2e device_path=disk#x access_mode=ro", "Invalid argument"},
	} {
		out, err := bash(t, "echo '"+tc.line+"' > "+c.devMnt+"/ctl/map_device")
		if err == nil || !strings.Contains(out, tc.want) {
			t.Errorf("map_device %q: %v %q, want %s", tc.line, err, out, tc.want)
		}
	}
	mustBash(t, "echo 'sessname=e2e device_path=other access_mode=ro' > "+c.devMnt+"/ctl/map_device")
	if conf := cat(c.cliConf); strings.Contains(conf, "disk#x") || strings.Contains(conf, "migration") || !strings.Contains(conf, "device_path=other") {
		t.Fatalf("client config after the refused maps:\n%s", conf)
	}
	st, err := os.Stat(c.nbdSock)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("NBD socket %v: %v", st.Mode(), err)
	}
}
