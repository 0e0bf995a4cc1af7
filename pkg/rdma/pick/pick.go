// Package pick chooses the RDMA provider a program runs on: soft (RDMA over TCP, always
// there), verbs (rdma-core, when the binary has it and the host has a device), or auto.
package pick

import (
	"fmt"
	"net"
	"net/netip"
	"strings"

	"github.com/rtrs-go/rtrs/pkg/rdma"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/rdma/verbs"
)

// Usage is the flag's help text.
const Usage = "RDMA provider: auto (verbs when this binary has it and an RDMA device with an active port serves the addresses, soft otherwise), soft (RDMA over TCP) or verbs (rdma-core)"

// Open returns the provider called name ("auto", "soft" or "verbs") and why it was chosen.
// addrs are the local addresses the program will use; none, or only unspecified ones, mean
// any device will do.
func Open(name string, addrs ...netip.Addr) (rdma.Provider, string, error) {
	return OpenWith(name, soft.Options{}, addrs...)
}

// OpenWith is Open with the options the soft provider gets if it is the one chosen; any
// provider may be returned.
func OpenWith(name string, so soft.Options, addrs ...netip.Addr) (rdma.Provider, string, error) {
	switch name {
	case "soft":
		return soft.New(so), "soft: asked for", nil
	case "verbs":
		p, err := verbs.New()
		if err != nil {
			return nil, "", err
		}
		return p, "verbs: asked for", nil
	case "auto", "":
		if !verbs.Built {
			return soft.New(so), "soft: this binary was built without verbs", nil
		}
		p, err := verbs.New()
		if err != nil {
			return soft.New(so), fmt.Sprintf("soft: no RDMA device (%v)", err), nil
		}
		dev, why := serving(p, addrs)
		if dev == "" {
			return soft.New(so), "soft: " + why, nil
		}
		return p, fmt.Sprintf("verbs: %s serves %s", dev, why), nil
	}
	return nil, "", fmt.Errorf("provider %q: want auto, soft or verbs: %w", name, rdma.ErrInvalid)
}

// serving returns a device with an active port whose interface holds every specified
// address of addrs (any active device when none is specified), and what it found.
func serving(p rdma.Provider, addrs []netip.Addr) (string, string) {
	devs, err := p.Devices()
	if err != nil || len(devs) == 0 {
		return "", "no RDMA device"
	}
	var want []netip.Addr
	for _, a := range addrs {
		if a.IsValid() && !a.IsUnspecified() {
			want = append(want, a.Unmap())
		}
	}
	var seen []string
	for _, d := range devs {
		dev, err := p.OpenDevice(d.Name)
		if err != nil {
			continue
		}
		pa, err := dev.QueryPort(1)
		if err != nil || pa.State != rdma.PortActive {
			seen = append(seen, d.Name+" (port not active)")
			continue
		}
		if len(want) == 0 {
			return d.Name, "every address"
		}
		if holdsAll(d.Interface, want) {
			return d.Name, fmt.Sprint(want)
		}
		seen = append(seen, fmt.Sprintf("%s (on %q, without %v)", d.Name, d.Interface, want))
	}
	return "", "no RDMA device with an active port serves the addresses: " + strings.Join(seen, ", ")
}

// holdsAll reports whether interface ifname has every address of want.
func holdsAll(ifname string, want []netip.Addr) bool {
	ifc, err := net.InterfaceByName(ifname)
	if err != nil {
		return false
	}
	as, err := ifc.Addrs()
	if err != nil {
		return false
	}
	have := map[netip.Addr]bool{}
	for _, a := range as {
		if pfx, err := netip.ParsePrefix(a.String()); err == nil {
			have[pfx.Addr().Unmap()] = true
		}
	}
	for _, a := range want {
		if !have[a] {
			return false
		}
	}
	return true
}
