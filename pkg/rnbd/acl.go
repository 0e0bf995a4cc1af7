package rnbd

import (
	"bufio"
	"fmt"
	"io"
	"net/netip"
	"path"
	"slices"
	"strings"
	"syscall"

	"github.com/rtrs-go/rtrs/pkg/transport"
)

// ACL says which clients may open which exports in which access modes. It is a list of rules,
// one per line of its file:
//
//	# export   client              modes
//	db/*       10.0.0.0/24         ro,rw
//	db/vol1    subject=CN=host-a   rw,migration
//	*          *                   ro
//
// export is a pattern (path.Match) over the device path a client asks for; client is "*", an
// address, a network, or subject=<certificate subject>; modes is a comma list of ro, rw and
// migration. A client may open an export in the modes of every rule that matches both; with
// no rule matching it may not open it at all.
//
// A server without an ACL lets every client open every export ro or rw, never migration:
// a second writer is something an export has to allow.
type ACL struct {
	rules []aclRule
}

type aclRule struct {
	export  string
	any     bool         // client "*"
	prefix  netip.Prefix // valid: an address rule
	subject string       // not empty: a subject rule
	modes   uint8        // bit per AccessMode
}

// ParseACL reads an ACL; name is for errors.
func ParseACL(r io.Reader, name string) (*ACL, error) {
	acl := &ACL{}
	sc := bufio.NewScanner(r)
	for ln := 1; sc.Scan(); ln++ {
		line, _, _ := strings.Cut(sc.Text(), "#")
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		bad := func(format string, a ...any) error {
			return fmt.Errorf("%s:%d: %s: %w", name, ln, fmt.Sprintf(format, a...), syscall.EINVAL)
		}
		if len(f) != 3 {
			return nil, bad("want: export client modes")
		}
		ru := aclRule{export: f[0]}
		if _, err := path.Match(ru.export, ""); err != nil {
			return nil, bad("export pattern %q: %v", f[0], err)
		}
		switch c := f[1]; {
		case c == "*":
			ru.any = true
		case strings.HasPrefix(c, "subject="):
			if ru.subject = strings.TrimPrefix(c, "subject="); ru.subject == "" {
				return nil, bad("empty subject")
			}
		default:
			p, err := netip.ParsePrefix(c)
			if err != nil {
				a, aerr := netip.ParseAddr(c)
				if aerr != nil {
					return nil, bad("client %q: want *, an address, a network or subject=...", c)
				}
				p = netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen())
			}
			ru.prefix = p.Masked()
		}
		for _, m := range strings.Split(f[2], ",") {
			mode, err := ParseAccessMode(m)
			if err != nil {
				return nil, bad("mode %q: want ro, rw or migration", m)
			}
			ru.modes |= 1 << mode
		}
		acl.rules = append(acl.rules, ru)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return acl, nil
}

// allows says whether the client who may open export in mode; a nil ACL is the default. The
// export is matched without leading slashes, with "//" and "." folded (path.Clean), so
// "/db//vol1" is "db/vol1". A name with a ".." in it matches nothing: the open resolves ".."
// after the links before it, so "scratch/lnk/../x" with lnk a link to db/sub opens db/x,
// which the name read as text ("scratch/x") would not say. Symbolic links inside the search
// path are not followed here: a rule that allows a directory allows what its links point to.
func (a *ACL) allows(export string, who transport.Identity, mode AccessMode) bool {
	if a == nil {
		return mode != AccessMigration
	}
	if slices.Contains(strings.Split(export, "/"), "..") {
		return false
	}
	export = path.Clean(strings.TrimLeft(export, "/"))
	addr := who.Addr.Unmap()
	for _, ru := range a.rules {
		if ru.modes&(1<<mode) == 0 {
			continue
		}
		if ok, _ := path.Match(ru.export, export); !ok {
			continue
		}
		switch {
		case ru.any:
			return true
		case ru.subject != "":
			if ru.subject == who.Subject {
				return true
			}
		case ru.prefix.Contains(addr):
			return true
		}
	}
	return false
}
