package transport

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
)

func prefixes(t *testing.T, s ...string) []AllowEntry {
	t.Helper()
	out, err := ParseAllow(strings.Join(s, ","))
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// tryOpen opens session name over ps and reports the error (the session is closed at once).
func tryOpen(e *env, name string, ps []PathAddrs) error {
	o := ClientOptions{Provider: e.prov, SessName: name, Paths: ps, Port: e.port, ConPerPath: 2,
		MaxReconnectAttempts: 0, Timings: Timings(testutil.FastTimings())}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := Open(ctx, o)
	if err == nil {
		_ = s.Close()
	}
	return err
}

// The allowlist admits the networks it names and refuses the others at the connection request.
func TestAllowlist(t *testing.T) {
	e := newLimitedEnv(t, func(o *ServerOptions) { o.Allow = prefixes(t, testAddr(1)+"/32") })
	if err := tryOpen(e, "inside", paths(t, path1())); err != nil {
		t.Fatalf("client in the allowlist: %v", err)
	}
	// Open returns the errno the server's reject carried in its conn_rsp (as the kernel's
	// rtrs_rdma_conn_rejected does), not a bare ECONNRESET.
	if err := tryOpen(e, "outside", paths(t, path2())); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("a client outside the allowlist: %v, want EPERM", err)
	}
	if got := connectFrom(t, e, netip.MustParseAddr(testAddr(2)), silentPath(1)); got != -int16(syscall.EPERM) {
		t.Fatalf("connection request from outside the allowlist: errno %d, want EPERM", got)
	}
}

// A path that names another client's paths_uuid (it is in every connection request that
// client sends) joins nothing when it comes from another identity: sessions are found by
// identity and paths_uuid. Sent while the victim's session is down, it does not keep the
// victim from coming back (the server would have held the uuid for the squatter), and the
// victim's IO goes on.
func TestStolenPathsUUIDRefused(t *testing.T) {
	e := newLimitedEnv(t, func(o *ServerOptions) { o.Allow = prefixes(t, testAddr(1)+"/32", testAddr(2)+"/32") })
	s := e.open(t, "victim", paths(t, path1()), nil)
	model := make([]byte, len(e.disk.disk))
	copy(model, e.disk.disk)
	join := MsgConnReq{Cid: 0, CidNum: 1, SessUUID: uuid.New(), PathsUUID: s.pathsUUID}
	if got := connectFrom(t, e, netip.MustParseAddr(testAddr(2)), join); got != -int16(syscall.EPERM) {
		t.Fatalf("a path joining a session by a stolen paths_uuid from another identity: errno %d, want EPERM", got)
	}
	if ss := e.srv.Sessions(); len(ss) != 1 || len(ss[0].Paths()) != 1 {
		t.Fatalf("the victim's session changed: %v", ss)
	}
	// The victim's only path goes on the server's side; before it reconnects, the squatter
	// makes a session with its paths_uuid.
	p := s.Paths()[0]
	e.srvPath(t, "ip:"+testAddr(1)).Close()
	steal := MsgConnReq{Cid: 0, CidNum: 2, SessUUID: uuid.New(), PathsUUID: s.pathsUUID, FirstConn: true}
	if got := connectFrom(t, e, netip.MustParseAddr(testAddr(2)), steal); got != 0 {
		t.Fatalf("the squatter's first connection: errno %d", got)
	}
	testutil.WaitFor(t, 10*time.Second, "the victim back", func() bool { return p.State() == StateConnected })
	randomIO(t, s, model, 300, 8, 5)
}

// A session name belongs to the identity that first used it, across a server restart: a
// squatter gets EPERM, and the owner gets its name back.
func TestSessionNameKeptAcrossRestart(t *testing.T) {
	names := filepath.Join(t.TempDir(), "sessions.json")
	allow := prefixes(t, testAddr(1)+"/32", testAddr(2)+"/32")
	e := newLimitedEnv(t, func(o *ServerOptions) { o.Allow, o.NamesFile = allow, names })
	if err := tryOpen(e, "tenant", paths(t, path1())); err != nil {
		t.Fatal(err)
	}
	if err := e.srv.Close(); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(names)
	if err != nil || !strings.Contains(string(b), `"tenant"`) {
		t.Fatalf("names file after the first server: %q, %v", b, err)
	}
	e2 := newLimitedEnv(t, func(o *ServerOptions) { o.Allow, o.NamesFile = allow, names })
	if err := tryOpen(e2, "tenant", paths(t, path2())); err == nil {
		t.Fatal("a squatter from another identity took the name after the restart")
	}
	if err := tryOpen(e2, "squatter", paths(t, path2())); err != nil {
		t.Fatalf("the other client with a name of its own: %v", err)
	}
	if err := tryOpen(e2, "tenant", paths(t, path1())); err != nil {
		t.Fatalf("the owner after the restart: %v", err)
	}
}

// Session and path names the config files or the trees could not carry are refused
// (names.Session's rules: internal/lib/names tests them one by one).
func TestValidName(t *testing.T) {
	for _, bad := range []string{"disk#x", "a b", "nl\n", "bad\xffutf8", "a.b", "a/b", "", strings.Repeat("x", 255)} {
		if err := validName(bad); !errors.Is(err, ErrInvalName) {
			t.Errorf("session name %q: %v, want ErrInvalName", bad, err)
		}
	}
	for _, good := range []string{"disk", "vol-1_a", "Ω", strings.Repeat("x", 254)} {
		if err := validName(good); err != nil {
			t.Errorf("%q refused: %v", good, err)
		}
	}
}

// With mutual TLS the client's identity is its certificate's subject: the subject allowlist
// admits and refuses by it, and a session is bound to it.
func TestTLSIdentity(t *testing.T) {
	pki := testutil.NewPKI(t, "rtrs-ca")
	nodeCfg := func(cn string) *tls.Config {
		return &tls.Config{Certificates: []tls.Certificate{pki.Issue(t, cn, true)}, RootCAs: pki.Pool, ClientCAs: pki.Pool,
			ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS13}
	}
	e := &env{prov: soft.New(soft.Options{TLS: nodeCfg("server")}), disk: newMemDisk(8 << 20)}
	o := DefaultServerOptions()
	o.Provider, o.Handler, o.Timings, o.QueueDepth = e.prov, e.disk, Timings(testutil.FastTimings()), 16
	o.Addr = netip.AddrPortFrom(netip.MustParseAddr(testAddr(1)), 0)
	o.AllowSubjects = []string{"CN=client-a", "CN=client-b"}
	srv, err := NewServer(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	e.srv, e.port = srv, srv.Addr().Port()
	as := func(cn string) *env {
		return &env{prov: soft.New(soft.Options{TLS: nodeCfg(cn)}), srv: srv, port: e.port}
	}

	a := as("client-a")
	s := a.open(t, "tenant-a", paths(t, path1()), nil)
	if got := srv.Sessions()[0].Owner(); got.Subject != "CN=client-a" || got.Key() != "subject:CN=client-a" {
		t.Fatalf("session owner %+v", got)
	}
	if err := tryOpen(as("client-c"), "tenant-c", paths(t, path1())); err == nil {
		t.Fatal("a subject outside the allowlist opened a session")
	}
	// client-b may connect, but not into client-a's session, even from the same address.
	b := as("client-b")
	steal := MsgConnReq{Cid: 0, CidNum: 1, SessUUID: uuid.New(), PathsUUID: s.pathsUUID}
	if got := connectFrom(t, b, netip.MustParseAddr(testAddr(1)), steal); got != -int16(syscall.EPERM) {
		t.Fatalf("client-b joining client-a's session: errno %d, want EPERM", got)
	}
	if err := tryOpen(b, "tenant-b", paths(t, path1())); err != nil {
		t.Fatalf("client-b with its own session: %v", err)
	}
	model := make([]byte, len(e.disk.disk))
	copy(model, e.disk.disk)
	randomIO(t, s, model, 200, 8, 6)
}

// An allowlist entry can hold a host's rails: both paths of its session join, while a path
// from another entry into the session is refused.
func TestAllowlistRails(t *testing.T) {
	e := newLimitedEnv(t, func(o *ServerOptions) { o.Allow = prefixes(t, testAddr(1)+"+"+testAddr(2)) })
	s := e.open(t, "railed", paths(t, path1(), path2()), nil)
	if n := len(s.Paths()); n != 2 {
		t.Fatalf("%d paths connected, want both rails", n)
	}
	sep := newLimitedEnv(t, func(o *ServerOptions) { o.Allow = prefixes(t, testAddr(1), testAddr(2)) })
	s2 := sep.open(t, "split", paths(t, path1()), nil)
	steal := MsgConnReq{Cid: 0, CidNum: 1, SessUUID: uuid.New(), PathsUUID: s2.pathsUUID}
	if got := connectFrom(t, sep, netip.MustParseAddr(testAddr(2)), steal); got != -int16(syscall.EPERM) {
		t.Fatalf("a path from another entry: errno %d, want EPERM", got)
	}
	for _, bad := range []string{"10.0.0.1+", "x", "10.0.0.0/33", ",,", " , ", "10.0.0.1,,10.0.0.2", "10.0.0.1,"} {
		if _, err := ParseAllow(bad); err == nil {
			t.Errorf("allowlist %q accepted", bad)
		}
	}
	for _, none := range []string{"", "  "} {
		if l, err := ParseAllow(none); err != nil || l != nil {
			t.Errorf("allowlist %q: %v, %v; want none, no error", none, l, err)
		}
	}
}

// One address cannot take every session: sessions that have not sent INFO_REQ are bounded per
// address, and all connections are bounded too.
func TestNewSessionsPerAddrAndConns(t *testing.T) {
	e := newLimitedEnv(t, func(o *ServerOptions) {
		o.Limits = ServerLimits{MaxNewSessionsPerAddr: 4, MaxConns: 11}
	})
	a2 := netip.MustParseAddr(testAddr(2))
	for i := range 4 {
		if got := connectFrom(t, e, a2, silentPath(1)); got != 0 {
			t.Fatalf("new session %d: errno %d", i, got)
		}
	}
	if got := connectFrom(t, e, a2, silentPath(1)); got != -int16(syscall.ECONNRESET) {
		t.Fatalf("5th new session from one address: errno %d, want ECONNRESET", got)
	}
	// Another address still gets in: 4 silent connections + 3 of this session = 7 of 11.
	s := e.open(t, "healthy", paths(t, path1()), nil)
	model := make([]byte, len(e.disk.disk))
	copy(model, e.disk.disk)
	randomIO(t, s, model, 200, 8, 7)
	// 7 + 3 = 10, and the third session's path (2 connections) does not fit in 11.
	_ = e.open(t, "second", paths(t, path1()), nil)
	if err := tryOpen(e, "third", paths(t, path1())); err == nil {
		t.Fatal("a session past the connection bound opened")
	}
}

// The names store refuses new names when full instead of forgetting old ones.
func TestNamesFull(t *testing.T) {
	ns, err := loadNames("")
	if err != nil {
		t.Fatal(err)
	}
	for i := range maxNames {
		if errno, _ := ns.claim(fmt.Sprintf("n%d", i), "addr:a", "", nil); errno != 0 {
			t.Fatalf("name %d: %v", i, errno)
		}
	}
	if errno, _ := ns.claim("late", "addr:b", "", nil); errno != syscall.ENOSPC {
		t.Fatalf("a new name in a full store: %v, want ENOSPC", errno)
	}
	if errno, _ := ns.claim("n0", "addr:a", "", nil); errno != 0 {
		t.Fatalf("the owner of a kept name: %v", errno)
	}
	if errno, _ := ns.claim("n1", "addr:b", "", nil); errno != syscall.EPERM {
		t.Fatalf("another owner's name: %v", errno)
	}
}

// One owner that names a client cannot take every name: at maxNamesPerOwner a new name
// replaces the owner's least recently claimed one that no live session uses, and is EDQUOT
// when all are in use; its kept names stay its, another owner's new name goes in, and an
// owner that is only an address family has the quota per address within it.
func TestNamesPerOwner(t *testing.T) {
	ns, err := loadNames("")
	if err != nil {
		t.Fatal(err)
	}
	inUse := map[string]bool{}
	for i := range maxNamesPerOwner {
		n := fmt.Sprintf("a%d", i)
		if errno, _ := ns.claim(n, "subject:CN=a", "subject:CN=a", inUse); errno != 0 {
			t.Fatalf("name %d: %v", i, errno)
		}
		inUse[n] = true
	}
	if errno, _ := ns.claim("a-late", "subject:CN=a", "subject:CN=a", inUse); errno != syscall.EDQUOT {
		t.Fatalf("a name past the owner's quota, all in use: %v, want EDQUOT", errno)
	}
	if errno, _ := ns.claim("a0", "subject:CN=a", "subject:CN=a", inUse); errno != 0 {
		t.Fatalf("a kept name of the owner at its quota: %v", errno)
	}
	// a1 and a2 no longer in use: a1 is the least recently claimed (a0 was just claimed again).
	delete(inUse, "a1")
	delete(inUse, "a2")
	if errno, _ := ns.claim("a-late", "subject:CN=a", "subject:CN=a", inUse); errno != 0 {
		t.Fatalf("a new name with an unused one to give up: %v", errno)
	}
	if _, kept := ns.names["a1"]; kept {
		t.Error("the owner's least recently claimed unused name is still kept")
	}
	if _, kept := ns.names["a2"]; !kept {
		t.Error("a name more recent than the one given up went")
	}
	if errno, _ := ns.claim("b0", "subject:CN=b", "subject:CN=b", nil); errno != 0 {
		t.Fatalf("another owner's new name: %v", errno)
	}
	// A full store: another owner's new name is ENOSPC, but the owner at its quota still
	// swaps an unused name of its own for a new one.
	for i := len(ns.names); i < maxNames; i++ {
		if errno, _ := ns.claim(fmt.Sprintf("f%d", i), "addr:ipv6", "", nil); errno != 0 {
			t.Fatalf("filling name %d: %v", i, errno)
		}
	}
	if errno, _ := ns.claim("b1", "subject:CN=b", "subject:CN=b", nil); errno != syscall.ENOSPC {
		t.Fatalf("a new name in a full store: %v, want ENOSPC", errno)
	}
	if errno, _ := ns.claim("a-new", "subject:CN=a", "subject:CN=a", inUse); errno != 0 {
		t.Fatalf("a swap at the owner's quota in a full store: %v", errno)
	}
	if _, kept := ns.names["a2"]; kept || len(ns.names) != maxNames {
		t.Errorf("after the swap: a2 kept %v, %d names", kept, len(ns.names))
	}
	for k := range ns.names {
		if strings.HasPrefix(k, "f") {
			delete(ns.names, k) // room for the family's names below
		}
	}
	// An owner shared by many hosts (an address family) has the room per address within it:
	// one address past its quota, all in use, is EDQUOT; another address of the family is not
	// held back by it.
	family := map[string]bool{}
	for i := range maxNamesPerOwner {
		n := fmt.Sprintf("v%d", i)
		if errno, _ := ns.claim(n, "addr:ipv4", "addr:ipv4 from:10.0.0.1", family); errno != 0 {
			t.Fatalf("name %d of one address of a family: %v", i, errno)
		}
		family[n] = true
	}
	if errno, _ := ns.claim("v-late", "addr:ipv4", "addr:ipv4 from:10.0.0.1", family); errno != syscall.EDQUOT {
		t.Fatalf("a name past one address's quota, all in use: %v, want EDQUOT", errno)
	}
	if errno, _ := ns.claim("w0", "addr:ipv4", "addr:ipv4 from:10.0.0.2", family); errno != 0 {
		t.Fatalf("another address of the family: %v", errno)
	}
}

// An identity names one client when it is a subject or an entry of single addresses.
func TestIdentityNamesClient(t *testing.T) {
	for ent, want := range map[string]bool{"ipv4": false, "ipv6": false, "10.0.3.0/24": false,
		"10.0.1.5/32+10.0.2.5/32": true, "10.0.1.5/32": true, "fd00::1/128": true, "10.0.1.5/32+10.0.2.0/24": false} {
		if got := (Identity{Entry: ent}).names(); got != want {
			t.Errorf("entry %q names one client: %v, want %v", ent, got, want)
		}
	}
	if !(Identity{Entry: "ipv4", Subject: "CN=a"}).names() {
		t.Error("a subject names one client")
	}
}

// One client cannot take every session: past MaxSessionsPerClient its new sessions are
// refused. A client is its address without an allowlist, its entry when the entry is one
// host's addresses (its rails share the budget), and its address again within an entry of
// networks (its neighbours do not share it).
func TestSessionsPerClient(t *testing.T) {
	a1, a2 := netip.MustParseAddr(testAddr(1)), netip.MustParseAddr(testAddr(2))
	// The smallest network holding both addresses.
	both := netip.PrefixFrom(a1, a1.BitLen())
	for !both.Contains(a2) {
		both, _ = both.Addr().Prefix(both.Bits() - 1)
	}
	for _, tc := range []struct {
		name    string
		allow   []string
		a1Opens bool
	}{
		{"no allowlist", nil, true},
		{"one host's entry", []string{a1.String() + "/" + fmt.Sprint(a1.BitLen()) + "+" + a2.String() + "/" + fmt.Sprint(a2.BitLen())}, false},
		{"a network entry", []string{both.String()}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newLimitedEnv(t, func(o *ServerOptions) {
				o.Limits = ServerLimits{MaxSessionsPerClient: 3}
				if tc.allow != nil {
					o.Allow = prefixes(t, tc.allow...)
				}
			})
			for i := range 3 {
				if got := connectFrom(t, e, a2, silentPath(1)); got != 0 {
					t.Fatalf("session %d: errno %d", i, got)
				}
			}
			if got := connectFrom(t, e, a2, silentPath(1)); got != -int16(syscall.ECONNRESET) {
				t.Fatalf("4th session of one client: errno %d, want ECONNRESET", got)
			}
			err := tryOpen(e, "other", paths(t, path1()))
			if tc.a1Opens && err != nil {
				t.Fatalf("a session from the other address: %v", err)
			}
			if !tc.a1Opens && err == nil {
				t.Fatal("a session from the same host's other rail opened past its bound")
			}
		})
	}
}
