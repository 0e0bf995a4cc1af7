package transport

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"time"

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

func (i Identity) String() string {
	if i.Subject != "" {
		return fmt.Sprintf("%s (%v)", i.Subject, i.Addr)
	}
	return fmt.Sprintf("%v (%s)", i.Addr, i.Entry)
}

// identify returns the identity of the peer of id, or false when the allowlist refuses it.
func (s *Server) identify(id rdma.ConnID) (Identity, bool) {
	a := id.RemoteAddr().Addr().Unmap()
	ident := Identity{Addr: a}
	if au, ok := id.(rdma.Authenticated); ok {
		ident.Subject = au.PeerSubject()
	}
	if len(s.opts.Allow) == 0 && len(s.opts.AllowSubjects) == 0 {
		ident.Entry = "ipv6"
		if a.Is4() {
			ident.Entry = "ipv4"
		}
		return ident, true
	}
	for _, p := range s.opts.Allow {
		if p.Contains(a) {
			ident.Entry = p.String()
			return ident, true
		}
	}
	if ident.Subject != "" {
		for _, sub := range s.opts.AllowSubjects {
			if sub == ident.Subject {
				ident.Entry = "subject"
				return ident, true
			}
		}
	}
	return ident, false
}

// maxNames bounds the names a server keeps for their owners; past it the one unused longest
// is forgotten.
const maxNames = 4096

// nameStore keeps which identity owns which session name, in a file when one is given, so a
// restarted server gives a name back to its owner only.
type nameStore struct {
	path string

	mu    sync.Mutex
	names map[string]nameOwner
}

type nameOwner struct {
	Owner string    `json:"owner"`
	Seen  time.Time `json:"seen"`
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
		return nil, fmt.Errorf("rtrs: session names in %s: %w", path, err)
	}
	for name := range ns.names {
		if validName(name) != nil {
			return nil, fmt.Errorf("rtrs: session names in %s: %q is not a session name", path, name)
		}
	}
	return ns, nil
}

// claim gives name to owner if it is free or owner's already; it reports whether it did.
func (ns *nameStore) claim(name, owner string) (bool, error) {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	if o, ok := ns.names[name]; ok && o.Owner != owner {
		return false, nil
	}
	_, known := ns.names[name]
	ns.names[name] = nameOwner{Owner: owner, Seen: time.Now().UTC()}
	if known {
		return true, nil // the time seen is not worth a write per connection
	}
	if len(ns.names) > maxNames {
		oldest := ""
		for n, o := range ns.names {
			if n != name && (oldest == "" || o.Seen.Before(ns.names[oldest].Seen)) {
				oldest = n
			}
		}
		delete(ns.names, oldest)
	}
	return true, ns.saveLocked()
}

// saveLocked writes the store atomically (a new file renamed over the old one).
func (ns *nameStore) saveLocked() error {
	if ns.path == "" {
		return nil
	}
	b, err := json.MarshalIndent(ns.names, "", "\t")
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(ns.path), ".sessions-*")
	if err != nil {
		return fmt.Errorf("rtrs: session names: %w", err)
	}
	_, err = tmp.Write(append(b, '\n'))
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), ns.path)
	}
	if err != nil {
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("rtrs: session names: %w", err)
	}
	return nil
}
