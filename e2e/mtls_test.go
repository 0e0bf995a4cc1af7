package e2e

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"golang.org/x/sys/unix"
)

// TestMutualTLSRefusals: the server of a mutual-TLS deployment (docs/security.md) refuses a
// client without a certificate, one whose certificate another CA signed (its subject is the
// allowed one, so only the CA check stops it), and one whose subject is not allowlisted, each
// with its own warning in the server's log; a client refuses a server whose certificate its
// CA did not sign, with the reason in its log and an errno on the control write. After each
// refusal the allowed client still reconnects a path (a new TLS handshake) and does IO.
func TestMutualTLSRefusals(t *testing.T) {
	dir := t.TempDir()
	pki := testutil.NewPKI(t, "e2e-ca")
	// Another CA under the same name: a certificate it signs names the trusted CA as its
	// issuer, so a client offers it (Go's client offers none the server's CA list does not
	// name) and only the signature check can refuse it.
	rogue := testutil.NewPKI(t, "e2e-ca")
	caFile, rogueCA := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "rogue-ca.pem")
	if err := os.WriteFile(caFile, pki.PEM, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(rogueCA, rogue.PEM, 0o600); err != nil {
		t.Fatal(err)
	}
	srvCert, srvKey := testutil.WriteFiles(t, dir, "server", pki.Issue(t, "storage-1", true, "10.77.1.2", "10.77.2.2"))
	cliCert, cliKey := testutil.WriteFiles(t, dir, "client", pki.Issue(t, "compute-1", false))
	c := startClusterWith(t,
		[]string{"-provider=soft", "-tls-cert=" + srvCert, "-tls-key=" + srvKey, "-tls-ca=" + caFile, "-allow-subject=CN=compute-1"},
		[]string{"-provider=soft", "-tls-cert=" + cliCert, "-tls-key=" + cliKey, "-tls-ca=" + caFile})
	c.openSession(t, "")
	dev := c.mapDisk(t)
	round := 0
	stillWorks := func(after string) {
		t.Helper()
		round++
		testutil.WaitFor(t, 30*time.Second, "allowed client connected after "+after, func() bool {
			return cat(c.pathFile(c.p1, "state")) == "connected\n" && cat(c.pathFile(c.p2, "state")) == "connected\n"
		})
		mustBash(t, "echo 1 > "+c.pathFile(c.p1, "reconnect"))
		if got := cat(c.pathFile(c.p1, "state")); got != "connected\n" {
			t.Fatalf("after %s the allowed client's path reconnects to %q", after, got)
		}
		devIO(t, dev, round)
	}
	stillWorks("the start")

	// srvLog returns what the server logged since mark (a length of its log).
	srvLog := func(mark int) string { return cat(c.srvd.log)[mark:] }
	waitLog := func(what string, log func() string, want ...string) {
		t.Helper()
		end := time.Now().Add(15 * time.Second)
		for {
			l := log()
			ok := true
			for _, w := range want {
				ok = ok && strings.Contains(l, w)
			}
			if ok {
				return
			}
			if time.Now().After(end) {
				t.Fatalf("%s: no log line with %q; the log has:\n%s", what, want, l)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}

	// No certificate: a TLS client with only the CA, from the client's namespace.
	mark := len(cat(c.srvd.log))
	if err := tlsInNetns(t, c.net.cli, "10.77.1.2:1234", &tls.Config{ServerName: "10.77.1.2", RootCAs: pki.Pool, MinVersion: tls.VersionTLS13}); err == nil || !strings.Contains(err.Error(), "certificate required") {
		t.Fatalf("a client without a certificate: %v, want TLS's certificate required alert", err)
	}
	waitLog("no certificate", func() string { return srvLog(mark) }, "refused: TLS handshake", "client didn't provide a certificate")
	stillWorks("the client without a certificate")

	// The server reports a refusal cause once a minute: a fresh one reports the next TLS one.
	c.srvd.stop()
	c.srvd.start()
	stillWorks("the server's restart")

	// refused starts another client with the certificate cert and the CA file ca, has it open
	// a session to the server, and checks that the control write fails with errno and that
	// the log of who refuses (the server's, or with atServer false the client's) says want.
	refused := func(what string, cert tls.Certificate, ca, errno string, atServer bool, want ...string) {
		t.Helper()
		mark := len(cat(c.srvd.log))
		cf, kf := testutil.WriteFiles(t, dir, fmt.Sprint("client-", round), cert)
		bad := startExtraClient(t, c, what, "-tls-cert="+cf, "-tls-key="+kf, "-tls-ca="+ca)
		out, err := openBadSession(t, bad, c.p1)
		if err == nil || !strings.Contains(out, errno) {
			t.Fatalf("%s: open_session: %v %q, want %s", what, err, out, errno)
		}
		if atServer {
			waitLog(what, func() string { return srvLog(mark) }, want...)
		} else {
			waitLog(what, func() string { return cat(bad.log) }, want...)
		}
		bad.stop()
		stillWorks(what)
	}
	// Signed by another CA, with the allowed subject.
	refused("a certificate from another CA", rogue.Issue(t, "compute-1", false), caFile, "Input/output error", true,
		"refused: TLS handshake", "certificate signed by unknown authority")
	// Signed by the CA, with a subject the allowlist does not name.
	refused("a subject not allowlisted", pki.Issue(t, "intruder", false), caFile, "Operation not permitted", true,
		"refused:", "CN=intruder", "is not in the allowlist")
	// The client's CA did not sign the server's certificate; its own certificate is good (the
	// server would take it), so only its check of the server's stops it.
	refused("a server certificate from a CA the client does not trust", pki.Issue(t, "compute-1", false), rogueCA, "Input/output error", false,
		"control write refused", "TLS with 10.77.1.2:1234: tls: failed to verify certificate", "certificate signed by unknown authority")
}

// startExtraClient starts another rtrs-clientd in the cluster's client namespace, with its
// own trees and the extra arguments, and waits for its control files.
func startExtraClient(t *testing.T, c *cluster, name string, args ...string) *daemon {
	t.Helper()
	dir := t.TempDir()
	conf := filepath.Join(dir, "rtrs-clientd.conf")
	if err := os.WriteFile(conf, []byte("# "+name+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, c.net.cli, "rtrs-clientd", append([]string{"-config=" + conf, "-mount=" + filepath.Join(dir, "cli"),
		"-dev-mount=" + filepath.Join(dir, "dev"), "-nbd-socket=", "-provider=soft", fastCli, fastRec, "-con-per-path=2"}, args...)...)
	testutil.WaitFor(t, 20*time.Second, name+"'s tree mounted", func() bool { return exists(filepath.Join(dir, "cli", "ctl", "open_session")) })
	return d
}

// openBadSession writes open_session for a session over path p to the extra client d.
func openBadSession(t *testing.T, d *daemon, p string) (string, error) {
	t.Helper()
	var mnt string
	for _, a := range d.args {
		if m, ok := strings.CutPrefix(a, "-mount="); ok {
			mnt = m
		}
	}
	return bash(t, fmt.Sprintf("echo 'sessname=bad path=%s' > %s/ctl/open_session", p, mnt))
}

// devIO writes a block of the device and reads it back through the device file.
func devIO(t *testing.T, dev string, round int) {
	t.Helper()
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	want := bytes.Repeat([]byte(fmt.Sprintf("mtls round %03d.", round)), 4096)
	off := int64(round) << 20
	if _, err := f.WriteAt(want, off); err != nil {
		t.Fatalf("write through the device: %v", err)
	}
	got := make([]byte, len(want))
	if _, err := f.ReadAt(got, off); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read back through the device (%v)", err)
	}
}

// tlsInNetns makes a TLS connection to addr from the network namespace ns with cfg and reads
// from it: it returns the first error (nil if a byte came). With TLS 1.3 a client learns that
// its certificate was refused at that read, from the server's alert.
func tlsInNetns(t *testing.T, ns, addr string, cfg *tls.Config) error {
	t.Helper()
	type result struct{ setup, err error }
	res := make(chan result, 1)
	go func() {
		// The thread is left locked so that it ends with the goroutine, in the namespace.
		runtime.LockOSThread()
		fd, err := unix.Open("/run/netns/"+ns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			res <- result{setup: err}
			return
		}
		err = unix.Setns(fd, unix.CLONE_NEWNET)
		_ = unix.Close(fd)
		if err != nil {
			res <- result{setup: err}
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		d := tls.Dialer{Config: cfg}
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			res <- result{err: err}
			return
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		_, err = conn.Read(make([]byte, 1))
		res <- result{err: err}
	}()
	r := <-res
	if r.setup != nil {
		t.Fatalf("entering namespace %s: %v", ns, r.setup)
	}
	return r.err
}
