package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/rtrs-go/rtrs/internal/daemon"
	"github.com/rtrs-go/rtrs/pkg/fsview"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// writtenBack marks the declarations rtrs-clientd writes into its config file.
const writtenBack = "# sessions and devices: written back by rtrs-clientd on every change"

// applyOne carries out one declaration; done says it needs no retry.
func (d *clientd) applyOne(ctx context.Context, line string) (done bool, err error) {
	verb, rest, _ := strings.Cut(line, " ")
	switch verb {
	case "open_session":
		o, pol, mra, err := fsview.ParseOpenSession(rest)
		if err != nil {
			return true, err // a bad line stays bad
		}
		if d.c.Session(o.SessName) != nil {
			return true, nil
		}
		err = d.c.OpenSession(ctx, o, func(co *transport.ClientOptions) {
			if pol != nil {
				co.Policy = *pol
			}
			if mra != nil {
				co.MaxReconnectAttempts = *mra
			}
		})
		if errors.Is(err, syscall.EEXIST) {
			return true, nil // opened meanwhile through the tree, which OpenSession waited for
		}
		return false, err
	case "map_device":
		r, err := fsview.ParseMapRequest(rest)
		if err != nil {
			return true, err
		}
		for _, dev := range d.c.Devices() {
			if dev.Session() == r.SessName && dev.Path() == r.DevicePath {
				return true, nil
			}
		}
		_, err = fsview.MapDevice(ctx, d.c, d.nbd, r)
		return false, err
	}
	return true, fmt.Errorf("unknown declaration %q", verb)
}

// apply carries out the declarations in order, and retries those that failed (a server
// that is not up yet) every few seconds until they succeed or the daemon stops.
func (d *clientd) apply(ctx context.Context, decls []string) {
	pending := decls
	for delay := time.Second; ; delay = min(2*delay, 30*time.Second) {
		var left []string
		for _, line := range pending {
			actx, cancel := context.WithTimeout(ctx, time.Minute)
			done, err := d.applyOne(actx, line)
			cancel()
			if err != nil {
				d.lg.WithError(err).Warnf("declaration %q", line)
			}
			d.mu.Lock()
			if err != nil && !done {
				left = append(left, line)
				d.pendingDecls[line] = true
			} else {
				delete(d.pendingDecls, line)
			}
			d.mu.Unlock()
		}
		d.mu.Lock()
		d.applied = true
		d.mu.Unlock()
		daemon.Notify("STATUS=" + d.status())
		if len(left) == 0 {
			return
		}
		pending = left
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
	}
}

// reload re-reads the config file and applies, with the same retries, the declarations the
// daemon does not have yet.
func (d *clientd) reload() {
	cfg, err := daemon.ReadConfig(d.cfgPath, true)
	if err != nil {
		d.lg.WithError(err).Warn("reload")
		return
	}
	d.lg.Infof("reload: %d declarations", len(cfg.Decls))
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		d.apply(d.ctx, cfg.Decls)
	}()
}

// declarations renders the sessions and devices of now, plus the declarations still
// waiting for their server.
func (d *clientd) declarations() []string {
	var out []string
	for _, name := range d.c.SessionNames() {
		s := d.c.Session(name)
		if s == nil {
			continue
		}
		line := fmt.Sprintf("open_session sessname=%s dest_port=%d", name, s.Port())
		for _, p := range s.Paths() {
			if p.State() == transport.StateDead {
				continue
			}
			src := ""
			if p.SrcAddr().IP.IsValid() && !p.SrcAddr().IP.IsUnspecified() {
				src = p.SrcAddr().String() + "@"
			}
			line += " path=" + src + p.DstAddr().String()
		}
		line += fmt.Sprintf(" mpath_policy=%s max_reconnect_attempts=%d", s.Policy(), s.MaxReconnectAttempts())
		out = append(out, line)
	}
	for _, dev := range d.c.Devices() {
		if dev.State() == rnbd.StateUnmapped || !dev.Opened() {
			continue
		}
		line := fmt.Sprintf("map_device sessname=%s device_path=%s access_mode=%v", dev.Session(), dev.Path(), dev.AccessMode())
		if tok := d.nbd.token(dev); tok != "" {
			line += " nbd=" + tok
		}
		out = append(out, line)
	}
	d.mu.Lock()
	var pend []string
	for l := range d.pendingDecls {
		pend = append(pend, l)
	}
	d.mu.Unlock()
	sort.Strings(pend)
	return append(out, pend...)
}

// writeBack rewrites the config file: its settings and comments as they were, then the
// declarations of now. The new file replaces the old one in one rename.
func (d *clientd) writeBack() {
	d.mu.Lock()
	applied := d.applied
	d.mu.Unlock()
	if !applied {
		return // the declarations of the file are not all tried yet
	}
	// Only a regular file (or none yet) is rewritten: never /dev/null or a pipe.
	if st, err := os.Stat(d.cfgPath); err == nil && !st.Mode().IsRegular() {
		return
	}
	decls := d.declarations()
	d.mu.Lock()
	defer d.mu.Unlock()
	var keep []string
	if f, err := os.Open(d.cfgPath); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			line := sc.Text()
			t := strings.TrimSpace(line)
			if t == writtenBack || strings.HasPrefix(t, "open_session ") || strings.HasPrefix(t, "map_device ") {
				continue
			}
			keep = append(keep, line)
		}
		f.Close()
	}
	for len(keep) > 0 && strings.TrimSpace(keep[len(keep)-1]) == "" {
		keep = keep[:len(keep)-1]
	}
	var b strings.Builder
	for _, l := range keep {
		b.WriteString(l + "\n")
	}
	if len(keep) > 0 {
		b.WriteString("\n")
	}
	b.WriteString(writtenBack + "\n")
	for _, l := range decls {
		b.WriteString(l + "\n")
	}
	if err := os.MkdirAll(filepath.Dir(d.cfgPath), 0o755); err != nil {
		d.lg.WithError(err).Warn("write-back")
		return
	}
	tmp := d.cfgPath + ".tmp"
	if err := os.WriteFile(tmp, []byte(b.String()), 0o644); err != nil {
		d.lg.WithError(err).Warn("write-back")
		return
	}
	if err := os.Rename(tmp, d.cfgPath); err != nil {
		d.lg.WithError(err).Warn("write-back")
	}
}
