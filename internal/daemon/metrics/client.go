package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/stats"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// pathStates are the client path states as the state label shows them (the sysfs state
// file's words, lower case).
var pathStates = []transport.PathState{transport.StateConnecting, transport.StateConnectingErr,
	transport.StateReconnecting, transport.StateConnected, transport.StateClosing, transport.StateClosed, transport.StateDead}

var deviceStates = []rnbd.DeviceState{rnbd.StateMapped, rnbd.StateDisconnected, rnbd.StateUnmapped, rnbd.StateClosedByServer}

// Client collects rtrs-clientd's metrics from its RNBD client at scrape time. Its sessions
// and paths are the ones the operator declared, so their labels are bounded by the config.
type Client struct {
	RNBD *rnbd.Client

	g                                                   guard
	ds                                                  descs
	sessions, failed, staged                            *prometheus.Desc
	reqs, bytes, inflight, failovers, reconnects, downs *prometheus.Desc
	state, hbRTT, latency                               *prometheus.Desc
	devices, devInfo, devSize                           *prometheus.Desc
}

// NewClient returns the collector of c.
func NewClient(c *rnbd.Client) *Client {
	m := &Client{RNBD: c}
	sp := []string{"session", "path"}
	spd := []string{"session", "path", "direction"}
	m.sessions = m.ds.add("rtrs_client_sessions", "RTRS sessions open.")
	m.failed = m.ds.add("rtrs_client_requests_failed_total", "Requests that failed, by cause: no_path (no connected path took them: ECONNABORTED), server (the server answered with an errno).", "session", "cause")
	m.staged = m.ds.add("rtrs_client_staged_requests_total", "Requests whose data was copied through their path's staging buffer (verbs: data outside memory registered for the session's front ends, as ublk's and NBD's buffers are), by post; stays 0 where no path stages.", "session")
	m.reqs = m.ds.add("rtrs_client_path_requests_total", "Requests completed on the path, by direction (stats/rdma's read and write counts, never reset).", spd...)
	m.bytes = m.ds.add("rtrs_client_path_bytes_total", "Bytes of the requests completed on the path (data and user header, as the kernel counts), by direction.", spd...)
	m.inflight = m.ds.add("rtrs_client_path_inflight", "Requests in flight on the path now, whatever the multipath policy.", sp...)
	m.failovers = m.ds.add("rtrs_client_path_failovers_total", "Requests the path took over from a failed path (stats/rdma's failovered, never reset).", sp...)
	m.reconnects = m.ds.add("rtrs_client_path_reconnects_total", "Reconnect attempts of the path, by result (ok, failed).", "session", "path", "result")
	m.downs = m.ds.add("rtrs_client_path_errors_total", "Times the connected path failed and went into error recovery, by cause: heartbeat, disconnect, completion, protocol, other.", "session", "path", "cause")
	m.state = m.ds.add("rtrs_client_path_state", "The path's state: 1 for the state it is in, 0 for the others.", "session", "path", "state")
	m.hbRTT = m.ds.add("rtrs_client_path_heartbeat_rtt_seconds", "The last heartbeat round trip of the path (absent before the first answer).", sp...)
	m.latency = m.ds.add("rtrs_client_path_request_latency_seconds", "Latency of the requests completed on the path, from submission to completion, by direction (stats/rdma_lat in finer buckets, never reset).", spd...)
	m.devices = m.ds.add("rtrs_rnbd_client_devices", "RNBD devices mapped, by state.", "state")
	m.devInfo = m.ds.add("rtrs_rnbd_client_device_info", "A mapped RNBD device: always 1, its access mode and state as labels.", "session", "device", "access_mode", "state")
	m.devSize = m.ds.add("rtrs_rnbd_client_device_size_bytes", "Size of the mapped device (0 until it is open).", "session", "device")
	return m
}

// Describe implements prometheus.Collector.
func (m *Client) Describe(ch chan<- *prometheus.Desc) { m.ds.describe(ch) }

// Collect implements prometheus.Collector.
func (m *Client) Collect(ch chan<- prometheus.Metric) {
	m.g.mu.Lock()
	defer m.g.mu.Unlock()
	e := newEmitter(ch)
	n := 0
	for _, name := range m.RNBD.SessionNames() {
		s := m.RNBD.Session(name)
		if s == nil {
			continue
		}
		n++
		m.session(e, name, s)
	}
	e.gauge(m.sessions, float64(n))
	byState := map[rnbd.DeviceState]int{}
	for _, d := range m.RNBD.Devices() {
		st := d.State()
		byState[st]++
		e.gauge(m.devInfo, 1, d.Session(), d.Path(), d.AccessMode().String(), deviceStateName(st))
		e.gauge(m.devSize, float64(d.Size()), d.Session(), d.Path())
	}
	for _, st := range deviceStates {
		e.gauge(m.devices, float64(byState[st]), deviceStateName(st))
		delete(byState, st)
	}
	for st, n := range byState { // states beyond the usual ones, while a device is in them
		e.gauge(m.devices, float64(n), deviceStateName(st))
	}
}

func deviceStateName(st rnbd.DeviceState) string { return label(st.String()) }

func (m *Client) session(e *emitter, name string, s *transport.Session) {
	noPath, server := s.FailedRequests()
	e.counter(m.failed, noPath, name, "no_path")
	e.counter(m.failed, server, name, "server")
	e.counter(m.staged, s.StagedRequests(), name)
	inflight := s.InflightByPath()
	for _, p := range s.Paths() {
		pn := p.Name()
		st := p.Stats
		e.counter(m.reqs, st.ReadCnt.Total(), name, pn, "read")
		e.counter(m.reqs, st.WriteCnt.Total(), name, pn, "write")
		e.counter(m.bytes, st.ReadBytes.Total(), name, pn, "read")
		e.counter(m.bytes, st.WriteBytes.Total(), name, pn, "write")
		e.gauge(m.inflight, float64(inflight[p]), name, pn)
		e.counter(m.failovers, st.Failovered.Total(), name, pn)
		e.counter(m.reconnects, st.ReconnectOK.Total(), name, pn, "ok")
		e.counter(m.reconnects, st.ReconnectFail.Total(), name, pn, "failed")
		for c := 0; c < stats.NumDownCauses; c++ {
			e.counter(m.downs, st.Down[c].Total(), name, pn, stats.DownCauseNames[c])
		}
		cur := p.State()
		for _, ps := range pathStates {
			v := 0.0
			if ps == cur {
				v = 1
			}
			e.gauge(m.state, v, name, pn, label(ps.String()))
		}
		if rtt := p.CurLatency(); rtt > 0 {
			e.gauge(m.hbRTT, rtt.Seconds(), name, pn)
		}
		e.latency(m.latency, &st.LatRead, name, pn, "read")
		e.latency(m.latency, &st.LatWrite, name, pn, "write")
	}
}
