package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/rtrs-go/rtrs/internal/daemon"
	"github.com/rtrs-go/rtrs/internal/lib/atomicfile"
	"github.com/rtrs-go/rtrs/pkg/control"
)

// writtenBack marks the declarations rtrs-clientd writes into its config file.
const writtenBack = "# sessions and devices: written back by rtrs-clientd on every change"

// startApply carries out decls (the config file's) in the background, in place of those of
// an earlier file. The earlier file's retries end and the declarations it still waited for
// are forgotten (a line the operator deleted before a SIGHUP is neither retried nor written
// back); a declaration it is carrying out now is let finish (its map rolled back under the
// new file's feet would leave the device neither mapped nor waiting), and the new file's
// apply starts after it. Write-back waits for the new file's first pass, as at start.
func (d *clientd) startApply(decls []string) {
	d.mu.Lock()
	if d.stopRetry != nil {
		close(d.stopRetry)
	}
	stop, done, prev := make(chan struct{}), make(chan struct{}), d.applyDone
	d.stopRetry, d.applyDone = stop, done
	d.gen++
	gen := d.gen
	d.pendingDecls = map[string]bool{}
	d.applied = false
	d.mu.Unlock()
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		defer close(done)
		if prev != nil {
			<-prev
		}
		select {
		case <-stop:
			return // a later file took over while this one waited
		default:
		}
		d.apply(gen, stop, decls)
	}()
}

// apply carries out the declarations in order, and retries those that failed (a server
// that is not up yet) every few seconds until they succeed, the daemon stops or a reload
// (a later gen, which closes stop) takes over.
func (d *clientd) apply(gen int, stop <-chan struct{}, decls []string) {
	pending := decls
	for delay := time.Second; ; delay = min(2*delay, 30*time.Second) {
		var left []string
		resolved := false
		for _, line := range pending {
			d.mu.Lock()
			current := gen == d.gen
			d.mu.Unlock()
			if !current {
				return // a later file took over: none of this one's lines is carried out
			}
			actx, cancel := context.WithTimeout(d.ctx, time.Minute)
			done, err := d.ctl.Apply(actx, line)
			cancel()
			d.mu.Lock()
			if gen != d.gen {
				d.mu.Unlock()
				return
			}
			if err != nil {
				d.lg.WithError(err).Warnf("declaration %q", line)
			}
			if !done {
				left = append(left, line)
				d.pendingDecls[line] = true
			} else if d.pendingDecls[line] {
				delete(d.pendingDecls, line)
				resolved = true
			}
			d.mu.Unlock()
		}
		d.mu.Lock()
		if gen != d.gen {
			d.mu.Unlock()
			return
		}
		d.applied = true
		skipped := d.skipped
		d.skipped = false
		d.mu.Unlock()
		if skipped || resolved {
			// What the tree changed while the first pass ran; or a declaration waiting in
			// the file is now the daemon's own, and its waiting copy goes.
			d.writeBack()
		}
		daemon.Notify("STATUS=" + d.status())
		if len(left) == 0 {
			return
		}
		pending = left
		select {
		case <-d.ctx.Done():
			return
		case <-stop:
			return
		case <-time.After(delay):
		}
	}
}

// checkDecls parses every declaration of a config file: the first that does not parse is
// the file's error, before any is carried out (the server refuses such a file too). A line
// that only failed at its run would be dropped by the next write-back.
func checkDecls(decls []string) error {
	for _, l := range decls {
		if err := control.CheckDeclaration(l); err != nil {
			return fmt.Errorf("declaration %q: %w", l, err)
		}
	}
	return nil
}

// reload is SIGHUP: the settings are loaded again as at start (the file's, the command
// line's winning); the log level follows them, and the file's declarations the daemon does
// not have yet are applied with the same retries. A file that would not start the daemon
// (a bad value, a declaration that does not parse) is refused whole: nothing changes.
func (d *clientd) reload() {
	c, cfg, err := daemon.Load("rtrs-clientd", usage, d.args, newConfig)
	if err == nil {
		_, err = c.check(cfg)
	}
	if err != nil {
		d.lg.WithError(err).Error("reload refused, nothing changed: the file would not start the daemon")
		return
	}
	if err := daemon.SetupLog(c.LogLevel, c.LogJSON); err != nil {
		d.lg.WithError(err).Warn("reload")
	}
	for _, ch := range daemon.Unapplied(&d.running, c, "log-level", "log-json") {
		d.lg.Warnf("reload: %s not applied: it takes effect at a restart", ch)
	}
	d.lg.Infof("reload: %d declarations", len(cfg.Decls))
	d.startApply(cfg.Decls)
}

// declarations are the sessions and devices of now (control.Client.Declarations, prev the
// declarations written before), plus the declarations still waiting for their server.
func (d *clientd) declarations(prev []string) []string {
	out := d.ctl.Declarations(prev)
	d.mu.Lock()
	var pend []string
	for l := range d.pendingDecls {
		pend = append(pend, l)
	}
	d.mu.Unlock()
	sort.Strings(pend)
	return append(out, pend...)
}

// stopWriteBack ends write-back for good: the daemon is stopping, and the sessions and
// devices its teardown closes are still what the operator declared.
func (d *clientd) stopWriteBack() {
	d.wbMu.Lock()
	defer d.wbMu.Unlock()
	d.mu.Lock()
	d.stopping = true
	d.mu.Unlock()
}

// writeBack rewrites the config file: its settings and comments as they were, then the
// declarations of now. The new file replaces the old one in one rename. Write-backs run one
// at a time, each from its own snapshot, so an older snapshot never lands after a newer one.
func (d *clientd) writeBack() {
	d.wbMu.Lock()
	defer d.wbMu.Unlock()
	d.mu.Lock()
	applied, stopping := d.applied, d.stopping
	if !applied {
		d.skipped = true // the declarations of the file are not all tried yet
	}
	d.mu.Unlock()
	if !applied || stopping {
		return
	}
	// Only a regular file (or none yet) is rewritten: never /dev/null or a pipe.
	if st, err := os.Stat(d.cfgPath); err == nil && !st.Mode().IsRegular() {
		return
	}
	var keep, prev []string
	if f, err := os.Open(d.cfgPath); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			line := sc.Text()
			if strings.TrimSpace(line) == writtenBack {
				continue
			}
			t := daemon.StripComment(strings.TrimSpace(line))
			if strings.HasPrefix(t, control.VerbOpenSession+" ") || strings.HasPrefix(t, control.VerbMapDevice+" ") {
				if control.CheckDeclaration(t) != nil {
					// Written since the last reload, and not the daemon's to judge: kept as
					// it stands, for the operator's next reload to refuse by name.
					keep = append(keep, line)
					continue
				}
				prev = append(prev, t)
				continue
			}
			keep = append(keep, line)
		}
		f.Close()
	}
	decls := d.declarations(prev)
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
	if err := atomicfile.Replace(d.cfgPath, []byte(b.String()), 0o644); err != nil {
		d.lg.WithError(err).Warn("write-back")
	}
}
