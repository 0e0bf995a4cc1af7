// Package log is the project's one wrapper over logrus: a context logger in the G(ctx) style.
// No other package imports logrus; they take an *Entry from here.
package log

import (
	"context"
	"io"
	"log"

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
