// Package metricstest reads a scrape in tests as Prometheus reads it: expfmt's parser of the
// format the daemon answered in, flattened into samples that can be compared across scrapes.
package metricstest

import (
	"fmt"
	"io"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
)

// Families is a parsed scrape by family name. Counter families are named with _total in
// both formats (OpenMetrics names the family without it).
type Families map[string]*dto.MetricFamily

// Parse parses body, which came in format.
func Parse(body string, format expfmt.Format) (Families, error) {
	dec := expfmt.NewDecoder(strings.NewReader(body), format)
	out := Families{}
	for {
		var mf dto.MetricFamily
		if err := dec.Decode(&mf); err == io.EOF {
			return out, nil
		} else if err != nil {
			return nil, err
		}
		name := mf.GetName()
		if mf.GetType() == dto.MetricType_COUNTER && !strings.HasSuffix(name, "_total") {
			name += "_total"
		}
		out[name] = &mf
	}
}

// Labels is a sample's labels as name=value pairs joined by commas, in the scrape's order.
func Labels(m *dto.Metric) string {
	var b []string
	for _, l := range m.GetLabel() {
		b = append(b, l.GetName()+"="+l.GetValue())
	}
	return strings.Join(b, ",")
}

// Counters are every counter sample and every histogram's count, sum and buckets, keyed
// name{labels} (a histogram's as name{labels}_count, _sum, _bucket{le=...}): the samples that
// must never go back.
func (f Families) Counters() map[string]float64 {
	out := map[string]float64{}
	for name, mf := range f {
		for _, m := range mf.GetMetric() {
			k := name + "{" + Labels(m) + "}"
			switch {
			case m.Counter != nil:
				out[k] = m.Counter.GetValue()
			case m.Histogram != nil:
				out[k+"_count"] = float64(m.Histogram.GetSampleCount())
				out[k+"_sum"] = m.Histogram.GetSampleSum()
				for _, b := range m.Histogram.GetBucket() {
					out[fmt.Sprintf("%s_bucket{le=%g}", k, b.GetUpperBound())] = float64(b.GetCumulativeCount())
				}
			}
		}
	}
	return out
}

// Gauges are every gauge sample, keyed name{labels}.
func (f Families) Gauges() map[string]float64 {
	out := map[string]float64{}
	for name, mf := range f {
		for _, m := range mf.GetMetric() {
			if m.Gauge != nil {
				out[name+"{"+Labels(m)+"}"] = m.Gauge.GetValue()
			}
		}
	}
	return out
}
