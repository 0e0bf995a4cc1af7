package transport

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/atomicfile"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// Identity is who a server session's client is, as far as the server can tell: the allowlist
// entry its address matched (or its address family when there is no allowlist), and the
// subject of its certificate when the provider authenticated it (rdma.Authenticated).
type Identity struct {
	// Addr is the address of the connection the identity was taken from.
	Addr netip.Addr
	// Entry is the allowlist entry Addr matched ("10.0.0.0/24"), or "ipv4"/"ipv6" when the
	// server has no allowlist.
	Entry string
	// Subject is the peer certificate's subject, empty without authentication.
	Subject string
}

// Key is what sessions are bound to: the subject when there is one, else the entry.
func (i Identity) Key() string {
	if i.Subject != "" {
		return "subject:" + i.Subject
	}
	return "addr:" + i.Entry
}

// names says whether the identity names one client: a certificate subject, or an allowlist
// entry of single addresses (one host's rails, "10.0.1.5+10.0.2.5"). An address family (no
// allowlist, no certificate) or an entry of networks ("10.0.3.0/24") is shared by many
// hosts, whose bounds must not be one budget.
func (i Identity) names() bool {
	if i.Subject != "" {
		return true
	}
	if i.Entry == "ipv4" || i.Entry == "ipv6" {
		return false
	}
	for _, part := range strings.Split(i.Entry, "+") {
		if p, err := netip.ParsePrefix(part); err != nil || !p.IsSingleIP() {
			return false
		}
	}
	return true
}

// clientKey is what the per-client bounds count by: the identity where it names a client,
// else the address group a session was made from (rdma.AddrGroup: an IPv6 client's /64)
// within its identity.
func clientKey(i Identity, from netip.Addr) string {
	if i.names() {
		return i.Key()
	}
	return i.Key() + " from:" + from.String()
}

func (i Identity) String() string {
	if i.Subject != "" {
		return fmt.Sprintf("%s (%v)", i.Subject, i.Addr)
	}
	return fmt.Sprintf("%v (%s)", i.Addr, i.Entry)
}

// AllowEntry is one allowlist entry: the networks one client, or a group of clients treated
// as one, connects from. A session is bound to the entry its creator matched, so the rails of
// one host belong in one entry ("10.0.1.5+10.0.2.5").
type AllowEntry []netip.Prefix

func (e AllowEntry) String() string {
	parts := make([]string, len(e))
	for i, p := range e {
		parts[i] = p.String()
	}
	return strings.Join(parts, "+")
}

func (e AllowEntry) contains(a netip.Addr) bool {
	for _, p := range e {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// ParseAllow reads an allowlist: entries separated by ',', each one or more networks or
// addresses joined by '+' ("10.0.1.5+10.0.2.5,10.0.3.0/24"). An empty (or blank) list is
// none, which admits everyone; an empty entry in a list is EINVAL, so that a list that is
// all separators (",,") cannot admit everyone by mistake.
func ParseAllow(v string) ([]AllowEntry, error) {
	var out []AllowEntry
	if strings.TrimSpace(v) == "" {
		return nil, nil
	}
	for _, f := range strings.Split(v, ",") {
		if f = strings.TrimSpace(f); f == "" {
			return nil, fmt.Errorf("allowlist %q: an empty entry: %w", v, syscall.EINVAL)
		}
		var e AllowEntry
		for _, n := range strings.Split(f, "+") {
			p, err := netip.ParsePrefix(n)
			if err != nil {
				a, aerr := netip.ParseAddr(n)
				if aerr != nil {
					return nil, fmt.Errorf("allowlist: %q is not a network or an address: %w", n, syscall.EINVAL)
				}
				p = netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen())
			}
			e = append(e, p.Masked())
		}
		out = append(out, e)
	}
	return out, nil
}

// identify returns the identity of the peer of id, and whether the allowlist admits it: its
// address must be in an entry of Allow (if any) and, with an authenticating provider, its
// subject in AllowSubjects (if any).
func (s *Server) identify(id rdma.ConnID) (Identity, bool) {
	a := id.RemoteAddr().Addr().Unmap()
	ident := Identity{Addr: a, Entry: "ipv6"}
	if a.Is4() {
		ident.Entry = "ipv4"
	}
	if au, ok := id.(rdma.Authenticated); ok {
		ident.Subject = au.PeerSubject()
	}
	addrOK := len(s.opts.Allow) == 0
	for _, e := range s.opts.Allow {
		if e.contains(a) {
			addrOK, ident.Entry = true, e.String()
			break
		}
	}
	subjOK := len(s.opts.AllowSubjects) == 0
	for _, sub := range s.opts.AllowSubjects {
		subjOK = subjOK || ident.Subject != "" && sub == ident.Subject
	}
	return ident, addrOK && subjOK
}

// maxNames bounds the names a server keeps for their owners; past it new names are refused
// (an operator removes old ones from the file). maxNamesPerOwner bounds one client's (as
// MaxSessionsPerClient counts clients: the owner where it names one, else the address a
// session came from within its owner), so that one tenant cannot take them all.
const (
	maxNames         = 4096
	maxNamesPerOwner = 256
)

// nameStore keeps which identity owns which session name, in a file when one is given, so a
// restarted server gives a name back to its owner only.
type nameStore struct {
	path string

	mu    sync.Mutex
	names map[string]nameOwner
}

type nameOwner struct {
	Owner string    `json:"owner"`
	Seen  time.Time `json:"seen"`             // when it was last claimed by a new session
	Quota string    `json:"client,omitempty"` // the client whose room it takes (clientKey)
}

// loadNames reads path (a missing file is an empty store; "" keeps names in memory only).
func loadNames(path string) (*nameStore, error) {
	ns := &nameStore{path: path, names: map[string]nameOwner{}}
	if path == "" {
		return ns, nil
	}
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return ns, nil
	}
	if err != nil {
		return nil, fmt.Errorf("rtrs: session names: %w", err)
	}
	if err := json.Unmarshal(b, &ns.names); err != nil {
		return nil, fmt.Errorf("rtrs: session names in %s: %w (the file is the server's own record of which client holds which name: move it away to start afresh, every name free again)", path, err)
	}
	for name := range ns.names {
		if validName(name) != nil {
			return nil, fmt.Errorf("rtrs: session names in %s: %q is not a session name", path, name)
		}
	}
	return ns, nil
}

// claim gives name to owner if it is free or owner's already, in the room of client (""
// for none). It answers 0, EPERM (another owner's), ENOSPC (maxNames kept: names are never
// forgotten to make room for another owner, so a flood of new names cannot push a tenant's
// out) or EDQUOT; err reports a names file not written. A client at maxNamesPerOwner gives
// up its own least recently claimed name that no live session uses (inUse) for the new one,
// also when the store is full, and is refused with EDQUOT only when all of them are in use.
func (ns *nameStore) claim(name, owner, client string, inUse map[string]bool) (syscall.Errno, error) {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	if o, ok := ns.names[name]; ok {
		if o.Owner != owner {
			return syscall.EPERM, nil
		}
		o.Seen, o.Quota = time.Now().UTC(), client
		ns.names[name] = o
		return 0, ns.saveLocked()
	}
	if client != "" {
		n, oldest := 0, ""
		for k, o := range ns.names {
			if o.Quota != client {
				continue
			}
			n++
			if inUse[k] {
				continue
			}
			// The least recently claimed; of equal times the first by name, so that the
			// choice does not depend on the map's order.
			if oldest == "" || o.Seen.Before(ns.names[oldest].Seen) || o.Seen.Equal(ns.names[oldest].Seen) && k < oldest {
				oldest = k
			}
		}
		if n >= maxNamesPerOwner {
			if oldest == "" {
				return syscall.EDQUOT, nil
			}
			delete(ns.names, oldest)
		}
	}
	// After the owner's own name has given way: a full store takes its new one in its place.
	if len(ns.names) >= maxNames {
		return syscall.ENOSPC, nil
	}
	ns.names[name] = nameOwner{Owner: owner, Seen: time.Now().UTC(), Quota: client}
	return 0, ns.saveLocked()
}

// saveLocked writes the store atomically (a new file synced and renamed over the old one).
func (ns *nameStore) saveLocked() error {
	if ns.path == "" {
		return nil
	}
	b, err := json.MarshalIndent(ns.names, "", "\t")
	if err != nil {
		return err
	}
	if err := atomicfile.Write(ns.path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("rtrs: session names: %w", err)
	}
	return nil
}
