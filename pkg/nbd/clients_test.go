package nbd_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/nbd"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// requireTool skips a test whose client is not installed, except under the test command
// (scripts/test.sh installs them and sets RTRS_REQUIRE_TOOLS), where it is a failure.
func requireTool(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("RTRS_REQUIRE_TOOLS") != "" {
			t.Fatalf("%s not installed (scripts/test.sh installs it)", name)
		}
		t.Skipf("%s not installed", name)
	}
	return p
}

// stack is the whole chain: a tmpfs file exported by an RNBD server over soft RTRS, mapped by
// an RNBD client over two paths, served by the NBD front end on a unix socket.
type stack struct {
	backing string
	sock    string
	dev     *rnbd.Device
	rs      *rnbd.Server
}

func (s *stack) uri() string { return "nbd+unix:///blk/disk?socket=" + s.sock }

func newStack(t *testing.T, size int) *stack {
	t.Helper()
	dir := t.TempDir()
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		if d, err := os.MkdirTemp("/dev/shm", "nbd-test-"); err == nil {
			dir = d
			t.Cleanup(func() { os.RemoveAll(d) })
		}
	}
	st := &stack{backing: filepath.Join(dir, "disk"), sock: filepath.Join(t.TempDir(), "nbd.sock")}
	if err := os.WriteFile(st.backing, make([]byte, size), 0o600); err != nil {
		t.Fatal(err)
	}
	prov := soft.New(soft.Options{})
	rs, err := rnbd.NewServer(rnbd.ServerOptions{SearchPath: dir})
	if err != nil {
		t.Fatal(err)
	}
	st.rs = rs
	so := transport.DefaultServerOptions()
	so.Provider, so.Handler = prov, rs
	so.Addr = netip.MustParseAddrPort("127.0.0.1:0")
	srv, err := transport.NewServer(so)
	if err != nil {
		t.Fatal(err)
	}
	c := rnbd.NewClient(rnbd.ClientOptions{Session: transport.ClientOptions{Provider: prov, MaxReconnectAttempts: -1}})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var paths []transport.PathAddrs
	for _, p := range []string{"ip:127.0.0.1@ip:127.0.0.1", "ip:127.0.0.2@ip:127.0.0.1"} {
		src, dst, err := transport.ParsePathAddrs(p)
		if err != nil {
			t.Fatal(err)
		}
		paths = append(paths, transport.PathAddrs{Src: src, Dst: dst})
	}
	st.dev, err = c.Map(ctx, rnbd.MapOptions{SessName: "blk", Paths: paths, Port: srv.Addr().Port(), DevicePath: "disk", AccessMode: rnbd.AccessRW})
	if err != nil {
		t.Fatal(err)
	}
	ns := nbd.NewServer(nbd.Options{Exports: func() []nbd.Export {
		return []nbd.Export{{Name: "blk/disk", Description: "rnbd blk:disk", Dev: st.dev}}
	}})
	ln, err := net.Listen("unix", st.sock)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- ns.Serve(ln) }()
	t.Cleanup(func() {
		ns.Close()
		<-served
		c.Close(context.Background())
		_ = srv.Close()
		rs.Close()
	})
	return st
}

func run(t *testing.T, name string, args ...string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return out
}

func randomFile(t *testing.T, size int, seed uint64) (string, []byte) {
	t.Helper()
	data := make([]byte, size)
	rng := rand.New(rand.NewPCG(seed, 0))
	for i := 0; i+8 <= size; i += 8 {
		v := rng.Uint64()
		for j := 0; j < 8; j++ {
			data[i+j] = byte(v >> (8 * j))
		}
	}
	p := filepath.Join(t.TempDir(), fmt.Sprintf("data-%d", seed))
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return p, data
}

func sameFile(t *testing.T, path string, want []byte) {
	t.Helper()
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if sha256.Sum256(got) != sha256.Sum256(want) {
		t.Fatalf("%s differs from what was written (%d vs %d bytes)", path, len(got), len(want))
	}
}

func TestNbdinfoList(t *testing.T) {
	leakcheck.Check(t)
	tool := requireTool(t, "nbdinfo")
	st := newStack(t, 16<<20)
	out := string(run(t, tool, "--list", "nbd+unix:///?socket="+st.sock))
	for _, want := range []string{"export=", "blk/disk", "rnbd blk:disk", "16777216"} {
		if !strings.Contains(out, want) {
			t.Fatalf("nbdinfo --list lacks %q:\n%s", want, out)
		}
	}
	out = string(run(t, tool, "--json", st.uri()))
	var info struct {
		Exports []struct {
			Name      string `json:"export-name"`
			Size      int64  `json:"export-size"`
			CanFlush  bool   `json:"can_flush"`
			CanFUA    bool   `json:"can_fua"`
			CanTrim   bool   `json:"can_trim"`
			CanZero   bool   `json:"can_zero"`
			MultiConn bool   `json:"can_multi_conn"`
			BlockMin  int    `json:"block_size_minimum"`
		} `json:"exports"`
	}
	if err := json.Unmarshal([]byte(out), &info); err != nil || len(info.Exports) != 1 {
		t.Fatalf("nbdinfo --json: %v\n%s", err, out)
	}
	e := info.Exports[0]
	if e.Size != 16<<20 || !e.CanFlush || !e.CanFUA || !e.CanTrim || !e.CanZero || !e.MultiConn || e.BlockMin != 512 {
		t.Fatalf("nbdinfo sees %+v", e)
	}
}

// TestNbdcopy copies a file in through the export (several connections) and back out.
func TestNbdcopy(t *testing.T) {
	leakcheck.Check(t)
	tool := requireTool(t, "nbdcopy")
	st := newStack(t, 32<<20)
	src, data := randomFile(t, 32<<20, 1)
	run(t, tool, "--connections=4", "--requests=16", src, st.uri())
	sameFile(t, st.backing, data)
	out := filepath.Join(t.TempDir(), "out")
	run(t, tool, st.uri(), out)
	sameFile(t, out, data)
}

// TestFioVerify runs fio's nbd engine with crc32c verification over the mapped device. The
// queue-depth-1 job also bounds every IO's latency far above any honest one and below the
// heartbeat interval (5 s here): a reply left waiting for the session's next completion, as
// before bfda810, fails it with ETIMEDOUT instead of passing slowly.

func TestFioVerify(t *testing.T) {
	leakcheck.Check(t)
	tool := requireTool(t, "fio")
	if out, _ := exec.Command(tool, "--enghelp=nbd").CombinedOutput(); !bytes.Contains(out, []byte("uri")) {
		t.Skip("fio has no nbd engine")
	}
	st := newStack(t, 32<<20)
	for _, job := range [][]string{
		{"--rw=randwrite", "--bs=4k", "--iodepth=32"},
		{"--rw=write", "--bs=1m", "--iodepth=8"},
		{"--rw=randrw", "--bsrange=512-256k", "--iodepth=16"},
		{"--rw=randrw", "--bs=4k", "--iodepth=1", "--max_latency=3s"},
	} {
		args := append([]string{"--name=verify", "--ioengine=nbd", "--uri=" + st.uri(), "--size=32m",
			"--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_state_save=0", "--output-format=json"}, job...)
		out := run(t, tool, args...)
		var res struct {
			Jobs []struct {
				Error int `json:"error"`
			} `json:"jobs"`
		}
		if i := bytes.IndexByte(out, '{'); i >= 0 {
			out = out[i:]
		}
		if err := json.Unmarshal(out, &res); err != nil || len(res.Jobs) != 1 || res.Jobs[0].Error != 0 {
			t.Fatalf("fio %v: %v\n%s", job, err, out)
		}
	}
	if st.rs.Stats.Writes.Value() == 0 || st.rs.Stats.Reads.Value() == 0 {
		t.Fatal("fio's IO did not reach the RNBD server")
	}
}

// TestQemuImg converts an image to and from the export.
func TestQemuImg(t *testing.T) {
	leakcheck.Check(t)
	tool := requireTool(t, "qemu-img")
	st := newStack(t, 16<<20)
	src, data := randomFile(t, 16<<20, 2)
	run(t, tool, "convert", "-n", "-f", "raw", "-O", "raw", src, st.uri())
	sameFile(t, st.backing, data)
	out := filepath.Join(t.TempDir(), "out.qcow2")
	run(t, tool, "convert", "-f", "raw", "-O", "qcow2", st.uri(), out)
	back := filepath.Join(t.TempDir(), "back.raw")
	run(t, tool, "convert", "-f", "qcow2", "-O", "raw", out, back)
	sameFile(t, back, data)
	info := string(run(t, tool, "info", "-f", "raw", st.uri()))
	if !strings.Contains(info, "16 MiB") {
		t.Fatalf("qemu-img info:\n%s", info)
	}
}

// TestLibnbdStartTLS: libnbd's tools speak STARTTLS with a client certificate to a listener
// that requires TLS (nbds://), copy data through it, and are refused without a certificate.
func TestLibnbdStartTLS(t *testing.T) {
	requireTool(t, "nbdinfo")
	requireTool(t, "nbdcopy")
	st := newStack(t, 16<<20)
	pki := testutil.NewPKI(t, "nbd-ca")
	dir := t.TempDir()
	// libnbd's layout: ca-cert.pem, client-cert.pem and client-key.pem in one directory.
	certs := filepath.Join(dir, "certs")
	cc, ck := testutil.WriteFiles(t, dir, "client", pki.Issue(t, "qemu-host", false))
	if err := os.MkdirAll(certs, 0o700); err != nil {
		t.Fatal(err)
	}
	for src, dst := range map[string]string{cc: "client-cert.pem", ck: "client-key.pem"} {
		if err := os.Rename(src, filepath.Join(certs, dst)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(certs, "ca-cert.pem"), pki.PEM, 0o600); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ns := nbd.NewServer(nbd.Options{Exports: func() []nbd.Export { return []nbd.Export{{Name: "blk/disk", Dev: st.dev}} }})
	served := make(chan error, 1)
	go func() {
		served <- ns.ServeTLS(ln, &tls.Config{Certificates: []tls.Certificate{pki.Issue(t, "rtrs-clientd", true)},
			ClientCAs: pki.Pool, ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12})
	}()
	t.Cleanup(func() { ns.Close(); <-served })
	uri := "nbds://" + ln.Addr().String() + "/blk/disk?tls-certificates=" + certs
	if out := string(run(t, "nbdinfo", uri)); !strings.Contains(out, "16777216") {
		t.Fatalf("nbdinfo over TLS:\n%s", out)
	}
	src := filepath.Join(dir, "src")
	data := make([]byte, 4<<20)
	for i := range data {
		data[i] = byte(i*13 + i>>9)
	}
	if err := os.WriteFile(src, data, 0o600); err != nil {
		t.Fatal(err)
	}
	run(t, "nbdcopy", src, uri)
	back := make([]byte, len(data))
	if _, err := st.dev.ReadAt(back, 0); err != nil || !bytes.Equal(back, data) {
		t.Fatalf("the device after nbdcopy over TLS: %v, equal %v", err, bytes.Equal(back, data))
	}
	// Plain NBD to the same listener, and TLS without a client certificate, are refused.
	if out, err := exec.Command("nbdinfo", "nbd://"+ln.Addr().String()+"/blk/disk").CombinedOutput(); err == nil {
		t.Fatalf("nbdinfo in clear was served:\n%s", out)
	}
	nocert := filepath.Join(dir, "nocert")
	if err := os.MkdirAll(nocert, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(nocert, "ca-cert.pem"), pki.PEM, 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("nbdinfo", "nbds://"+ln.Addr().String()+"/blk/disk?tls-certificates="+nocert).CombinedOutput(); err == nil {
		t.Fatalf("nbdinfo without a client certificate was served:\n%s", out)
	}
}

// TestRangeOpsOverRNBD sends TRIM and WRITE_ZEROES with and without NO_HOLE through the whole
// chain: the RNBD server sees DISCARD and WRITE_ZEROES, with NOUNMAP only for NO_HOLE, and the
// backing file keeps exactly the NO_HOLE range allocated.
func TestRangeOpsOverRNBD(t *testing.T) {
	leakcheck.Check(t)
	st := newStack(t, 4<<20)
	cl := nbd.DialRaw(t, st.sock, "blk/disk")
	if cl.Flags()&(nbd.TFlagSendTrim|nbd.TFlagWriteZeroes) != nbd.TFlagSendTrim|nbd.TFlagWriteZeroes {
		t.Fatalf("flags %#x: TRIM or WRITE_ZEROES not advertised", cl.Flags())
	}
	if e := cl.Do(nbd.Request{Type: nbd.CmdWrite, Cookie: 1, Length: 4 << 20}, bytes.Repeat([]byte{0xa5}, 4<<20)); e != 0 {
		t.Fatalf("write: errno %d", e)
	}
	blocks := func() int64 {
		var s syscall.Stat_t
		if err := syscall.Stat(st.backing, &s); err != nil {
			t.Fatal(err)
		}
		return s.Blocks
	}
	full := blocks()
	for i, r := range []nbd.Request{
		{Type: nbd.CmdTrim, Offset: 1 << 20, Length: 1 << 20},
		{Type: nbd.CmdWriteZeroes, Offset: 2 << 20, Length: 1 << 20},
		{Type: nbd.CmdWriteZeroes, Flags: nbd.CmdFlagNoHole, Offset: 3 << 20, Length: 1 << 20},
	} {
		r.Cookie = uint64(10 + i)
		if e := cl.Do(r, nil); e != 0 {
			t.Fatalf("%+v: errno %d", r, e)
		}
	}
	s := &st.rs.Stats
	if s.Discards.Value() != 1 || s.WriteZeroes.Value() != 2 || s.NoUnmapZeroes.Value() != 1 {
		t.Errorf("server saw discards %d write zeroes %d (nounmap %d), want 1 2 1",
			s.Discards.Value(), s.WriteZeroes.Value(), s.NoUnmapZeroes.Value())
	}
	// Two of the four MiB punched, the NO_HOLE one still allocated.
	if got, want := blocks(), full-2*(1<<20)/512; got != want {
		t.Errorf("%d blocks allocated after TRIM and WRITE_ZEROES, want %d", got, want)
	}
	data, err := os.ReadFile(st.backing)
	if err != nil || !bytes.Equal(data[1<<20:], make([]byte, 3<<20)) || data[1<<20-1] != 0xa5 {
		t.Errorf("backing file not zeroed as asked (%v)", err)
	}
}
