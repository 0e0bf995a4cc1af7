// Package log is the project's one wrapper over logrus: a context logger in the G(ctx) style.
// No other package imports logrus; they take an *Entry from here.
package log

import (
	"context"
	"io"
	"log"
	"net/netip"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
)

// Entry is a logger with fields attached.
type Entry = logrus.Entry

// Fields are key/value pairs attached to an Entry.
type Fields = logrus.Fields

// L is the base entry used when a context carries none.
var L = logrus.NewEntry(logrus.StandardLogger())

type loggerKey struct{}

// WithLogger returns a context that carries e; G(ctx) returns it.
func WithLogger(ctx context.Context, e *Entry) context.Context {
	return context.WithValue(ctx, loggerKey{}, e)
}

// G returns the logger carried by ctx, or L.
func G(ctx context.Context) *Entry {
	if ctx != nil {
		if e, ok := ctx.Value(loggerKey{}).(*Entry); ok {
			return e
		}
	}
	return L
}

// Options configure the base logger.
type Options struct {
	Level  string    // panic, fatal, error, warn, info, debug, trace; empty means info
	JSON   bool      // JSON lines instead of text
	NoTime bool      // omit timestamps (journald adds its own)
	Out    io.Writer // nil keeps the current output (stderr)
}

// Setup configures the base logger from o and returns it.
func Setup(o Options) (*Entry, error) {
	lg := logrus.StandardLogger()
	lvl := logrus.InfoLevel
	if o.Level != "" {
		var err error
		if lvl, err = logrus.ParseLevel(o.Level); err != nil {
			return nil, err
		}
	}
	lg.SetLevel(lvl)
	if o.JSON {
		lg.SetFormatter(&logrus.JSONFormatter{DisableTimestamp: o.NoTime})
	} else {
		lg.SetFormatter(&logrus.TextFormatter{DisableTimestamp: o.NoTime, FullTimestamp: true})
	}
	if o.Out != nil {
		lg.SetOutput(o.Out)
	}
	return L, nil
}

// StdLogger returns a standard library logger that writes into e at the given level, for
// libraries (go-fuse) that want a *log.Logger.
func StdLogger(e *Entry, level string) *log.Logger {
	lvl, err := logrus.ParseLevel(level)
	if err != nil {
		lvl = logrus.DebugLevel
	}
	return log.New(e.WriterLevel(lvl), "", 0)
}

// Limiter reports refusals once per cause and peer host: the first with its peer, then at
// most one line per interval saying how many more there were and the last peer, so that a
// peer refused again and again hides neither itself nor other peers refused for the same
// cause. Causes are a fixed set of words chosen by the caller, never peer input; hosts are
// kept for at most limiterHosts at once (IPv6 ones by /64), past which the others share
// one line per cause: its memory is bounded.
type Limiter struct {
	// Every is the least time between two lines of one cause and host (default one minute).
	Every time.Duration

	mu     sync.Mutex
	causes map[limitKey]*limited
}

type limitKey struct{ cause, host string }

// flushedCount is what a forgotten host had left to report.
type flushedCount struct {
	limitKey
	missed int
}

type limited struct {
	last   time.Time
	missed int
}

// limiterHosts bounds the cause and host pairs a Limiter keeps.
const limiterHosts = 256

// hostOf is the part of a peer that names its host: the address without its port, an IPv6
// one's /64; anything that is not an address as it is (a socket's name, an export's).
func hostOf(peer string) string {
	a, err := netip.ParseAddr(peer)
	if err != nil {
		ap, err := netip.ParseAddrPort(peer)
		if err != nil {
			return peer
		}
		a = ap.Addr()
	}
	if a = a.Unmap(); a.Is6() {
		if p, err := a.Prefix(64); err == nil {
			return p.String()
		}
	}
	return a.String()
}

// Warn logs that peer was refused for cause (with detail), unless cause was reported for
// peer's host less than Every ago: then it only counts it.
func (l *Limiter) Warn(e *Entry, cause, peer, detail string) {
	l.report(e, cause, peer, "refused: "+detail)
}

// Note logs msg about peer (a host, or what else the line is about) for cause as Warn does,
// without calling it a refusal: a failure the peer did not cause, such as an export's.
func (l *Limiter) Note(e *Entry, cause, peer, msg string) { l.report(e, cause, peer, msg) }

func (l *Limiter) report(e *Entry, cause, peer, msg string) {
	every := l.Every
	if every <= 0 {
		every = time.Minute
	}
	now := time.Now()
	l.mu.Lock()
	if l.causes == nil {
		l.causes = map[limitKey]*limited{}
	}
	k := limitKey{cause, hostOf(peer)}
	c := l.causes[k]
	var flushed []flushedCount
	if c == nil && len(l.causes) >= limiterHosts {
		// Forget the hosts whose interval is over, saying what they still had to report;
		// failing room, the others share a line.
		for old, v := range l.causes {
			if now.Sub(v.last) >= every {
				if v.missed > 0 {
					flushed = append(flushed, flushedCount{old, v.missed})
				}
				delete(l.causes, old)
			}
		}
		if len(l.causes) >= limiterHosts {
			k.host = "*"
			c = l.causes[k]
		}
	}
	defer func() {
		for _, fc := range flushed {
			e.WithFields(Fields{"peer": fc.host, "cause": fc.cause, "refused_since_last_report": fc.missed}).Warn("refused: more of the same")
		}
	}()
	if c == nil {
		c = &limited{}
		l.causes[k] = c
	}
	if !c.last.IsZero() && now.Sub(c.last) < every {
		c.missed++
		l.mu.Unlock()
		return
	}
	missed := c.missed
	c.last, c.missed = now, 0
	l.mu.Unlock()
	f := Fields{"peer": peer, "cause": cause}
	if missed > 0 {
		f["refused_since_last_report"] = missed
	}
	e.WithFields(f).Warn(msg)
}
