// Package metrics serves the daemons' statistics to Prometheus: collectors that read the live
// counters of pkg/transport and pkg/rnbd at scrape time (nothing is counted twice, and the IO
// path pays nothing for them), and an HTTP listener with timeouts that serves them in the
// Prometheus text format or OpenMetrics, as the scraper asks. Every counter is the monotonic
// total of pkg/stats, never the sysfs view: reset_all does not move it. docs/metrics.md lists
// the metrics.
package metrics

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/stats"
)

// FlagUsage is the -metrics flag's description, the same for both daemons.
const FlagUsage = "address to serve Prometheus/OpenMetrics metrics on at /metrics, e.g. 127.0.0.1:9851 (empty: off)"

// Timeouts of the listener: a scraper that stalls cannot hold a connection for long.
var readHeaderTimeout = 5 * time.Second // a variable for the test

const (
	readTimeout   = 10 * time.Second
	writeTimeout  = 30 * time.Second
	idleTimeout   = 60 * time.Second
	scrapeTimeout = 20 * time.Second
	maxScrapes    = 4 // scrapes served at once; more get 503
)

// Listener is a running metrics listener.
type Listener struct {
	srv  *http.Server
	ln   net.Listener
	done chan struct{}
}

// NewRegistry returns a registry holding cs (no Go runtime or process collectors: the
// metrics are the daemon's, node_exporter and the like have the rest).
func NewRegistry(cs ...prometheus.Collector) (*prometheus.Registry, error) {
	reg := prometheus.NewRegistry()
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return reg, nil
}

// Listen serves reg at http://addr/metrics until Close.
func Listen(addr string, reg *prometheus.Registry, lg *log.Entry) (*Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		EnableOpenMetrics:   true,
		ErrorHandling:       promhttp.ContinueOnError,
		ErrorLog:            errorLog{lg},
		MaxRequestsInFlight: maxScrapes,
		Timeout:             scrapeTimeout,
	}))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprintln(w, "rtrs metrics: /metrics")
	})
	s := &Listener{ln: ln, done: make(chan struct{}), srv: &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: readHeaderTimeout,
		ReadTimeout:       readTimeout,
		WriteTimeout:      writeTimeout,
		IdleTimeout:       idleTimeout,
		MaxHeaderBytes:    16 << 10,
	}}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			lg.WithError(err).Warn("metrics listener")
		}
	}()
	return s, nil
}

// Addr is the address the listener is bound to.
func (s *Listener) Addr() net.Addr { return s.ln.Addr() }

// Close stops the listener: scrapes in progress get a few seconds, then their connections are
// closed. It returns once the serving goroutine has ended.
func (s *Listener) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	err := s.srv.Shutdown(ctx)
	if err != nil {
		err = s.srv.Close()
	}
	<-s.done
	return err
}

type errorLog struct{ lg *log.Entry }

func (e errorLog) Println(v ...any) { e.lg.Warn(append([]any{"metrics: "}, v...)...) }

// emitter sends metrics, each label set of a metric once: a second path of a session with
// the same name (a new connection beside a closing one) would otherwise fail the scrape.
type emitter struct {
	ch   chan<- prometheus.Metric
	seen map[string]bool
}

func newEmitter(ch chan<- prometheus.Metric) *emitter {
	return &emitter{ch: ch, seen: map[string]bool{}}
}

func (e *emitter) key(d *prometheus.Desc, lv []string) string {
	return d.String() + "\xff" + strings.Join(lv, "\xff")
}

func (e *emitter) first(d *prometheus.Desc, lv []string) bool {
	k := e.key(d, lv)
	if e.seen[k] {
		return false
	}
	e.seen[k] = true
	return true
}

func (e *emitter) counter(d *prometheus.Desc, v uint64, lv ...string) {
	if e.first(d, lv) {
		e.ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), lv...)
	}
}

func (e *emitter) gauge(d *prometheus.Desc, v float64, lv ...string) {
	if e.first(d, lv) {
		e.ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, lv...)
	}
}

// latency sends l's totals as a histogram in seconds.
func (e *emitter) latency(d *prometheus.Desc, l *stats.Latency, lv ...string) {
	if !e.first(d, lv) {
		return
	}
	b, n, sum := l.Snapshot()
	cum := make(map[float64]uint64, stats.LatFine)
	var acc uint64
	for i := 0; i < stats.LatFine; i++ {
		acc += b[i]
		cum[stats.LatBoundSeconds(i)] = acc
	}
	e.ch <- prometheus.MustNewConstHistogram(d, n, float64(sum)/1e9, cum, lv...)
}

// descs is a set of descriptions, sent by Describe.
type descs []*prometheus.Desc

func (ds *descs) add(name, help string, labels ...string) *prometheus.Desc {
	d := prometheus.NewDesc(name, help, labels, nil)
	*ds = append(*ds, d)
	return d
}

func (ds descs) describe(ch chan<- *prometheus.Desc) {
	for _, d := range ds {
		ch <- d
	}
}

// guard serialises collections: two scrapes at once would only double the work.
type guard struct{ mu sync.Mutex }

// label makes a cause into a label value: "not allowed" → "not_allowed".
func label(s string) string {
	return strings.NewReplacer(" ", "_", "-", "_").Replace(strings.ToLower(s))
}

// Serve registers cs and serves them at http://addr/metrics (Listen), logging where.
func Serve(addr string, lg *log.Entry, cs ...prometheus.Collector) (*Listener, error) {
	reg, err := NewRegistry(cs...)
	if err != nil {
		return nil, err
	}
	l, err := Listen(addr, reg, lg)
	if err != nil {
		return nil, err
	}
	lg.Infof("metrics at http://%s/metrics", l.Addr())
	return l, nil
}
