package metrics

import (
	"sort"
	"strconv"
	"syscall"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// Server collects rtrs-serverd's metrics at scrape time. Its sessions and paths are the
// clients', so the label sets are bounded by the server's limits: -max-sessions sessions
// (only named ones, past INFO_REQ, are shown) and paths that each hold at least one of
// -max-conns connections; the cause and errno labels come from fixed sets in the code.
type Server struct {
	Transport *transport.Server
	RNBD      *rnbd.Server // may be nil

	g                                                         guard
	ds                                                        descs
	sessions, paths, chunkMem, rejected, refused              *prometheus.Desc
	reqs, bytes, inflight, state, hbRTT                       *prometheus.Desc
	rnbdReqs, rnbdZC, rnbdFUA, rnbdFlags, rnbdErrors, devOpen *prometheus.Desc
	devices, openRefused                                      *prometheus.Desc
}

// NewServer returns the collector of s and its RNBD server r.
func NewServer(s *transport.Server, r *rnbd.Server) *Server {
	m := &Server{Transport: s, RNBD: r}
	sp := []string{"session", "path"}
	spd := []string{"session", "path", "direction"}
	m.sessions = m.ds.add("rtrs_server_sessions", "RTRS sessions with a name (a path has sent INFO_REQ).")
	m.paths = m.ds.add("rtrs_server_paths", "Paths of the session, connected or closing.", "session")
	m.chunkMem = m.ds.add("rtrs_server_chunk_memory_bytes", "Chunk memory allocated for all sessions.")
	m.rejected = m.ds.add("rtrs_server_connections_rejected_total", "Connection requests answered with a reject, by the errno the reject carried.", "errno")
	m.refused = m.ds.add("rtrs_server_refusals_total", "Clients refused (a connection rejected, or a path closed for what its client did), by cause: the words of the log's warning.", "cause")
	m.reqs = m.ds.add("rtrs_server_path_requests_total", "Requests the path handed up, by direction (stats/rdma's counts, never reset).", spd...)
	m.bytes = m.ds.add("rtrs_server_path_bytes_total", "Bytes of the requests the path handed up, by direction.", spd...)
	m.inflight = m.ds.add("rtrs_server_path_inflight", "Requests handed up on the path and not answered yet.", sp...)
	m.state = m.ds.add("rtrs_server_path_state", "The path's state: 1 for the state it is in (connected, disconnected), 0 for the other.", "session", "path", "state")
	m.hbRTT = m.ds.add("rtrs_server_path_heartbeat_rtt_seconds", "The last heartbeat round trip of the path (absent before the first answer).", sp...)
	m.rnbdReqs = m.ds.add("rtrs_rnbd_server_requests_total", "RNBD requests served, by operation.", "op")
	m.rnbdZC = m.ds.add("rtrs_rnbd_server_zero_copy_reads_total", "Reads answered straight from the page cache (a part of the reads).")
	m.rnbdFUA = m.ds.add("rtrs_rnbd_server_fua_writes_total", "Writes with FUA (a part of the writes).")
	m.rnbdFlags = m.ds.add("rtrs_rnbd_server_request_flags_total", "RNBD requests by protocol 2.2 flag: preflush, nounmap.", "flag")
	m.rnbdErrors = m.ds.add("rtrs_rnbd_server_errors_total", "RNBD requests answered with an error.")
	m.openRefused = m.ds.add("rtrs_rnbd_server_open_refusals_total", "OPENs (map_device) answered with an error, by errno: ENOENT no such export, EACCES outside the search path or the ACL, EPERM the access mode, EEXIST open in another mode.", "errno")
	m.devices = m.ds.add("rtrs_rnbd_server_devices", "Devices the session has open.", "session")
	m.devOpen = m.ds.add("rtrs_rnbd_server_device_open", "An export a session has open: always 1, its access mode as a label.", "session", "device", "access_mode")
	return m
}

// errnoLabel names errno as a label value: EACCES, or its number if it has no name.
func errnoLabel(errno syscall.Errno) string {
	if name := unix.ErrnoName(errno); name != "" {
		return name
	}
	return strconv.Itoa(int(errno))
}

// Describe implements prometheus.Collector.
func (m *Server) Describe(ch chan<- *prometheus.Desc) { m.ds.describe(ch) }

// Collect implements prometheus.Collector.
func (m *Server) Collect(ch chan<- prometheus.Metric) {
	m.g.mu.Lock()
	defer m.g.mu.Unlock()
	e := newEmitter(ch)
	sessions := m.Transport.Sessions()
	e.gauge(m.sessions, float64(len(sessions)))
	e.gauge(m.chunkMem, float64(m.Transport.ChunkMemory()))
	for errno, n := range m.Transport.Rejected() {
		e.counter(m.rejected, n, errnoLabel(errno))
	}
	for cause, n := range m.Transport.Refused() {
		e.counter(m.refused, n, label(cause))
	}
	if m.RNBD != nil {
		for errno, n := range m.RNBD.OpenRefused() {
			e.counter(m.openRefused, n, errnoLabel(errno))
		}
	}
	for _, ss := range sessions {
		name := ss.Name()
		paths := ss.ListedPaths()
		e.gauge(m.paths, float64(len(paths)), name)
		// A connected path first: one that closes beside it with the same name is left out.
		sort.SliceStable(paths, func(i, j int) bool { return paths[i].State() == "connected" && paths[j].State() != "connected" })
		for _, p := range paths {
			pn := p.Name()
			st := &p.Stats
			e.counter(m.reqs, st.ReadCnt.Total(), name, pn, "read")
			e.counter(m.reqs, st.WriteCnt.Total(), name, pn, "write")
			e.counter(m.bytes, st.ReadBytes.Total(), name, pn, "read")
			e.counter(m.bytes, st.WriteBytes.Total(), name, pn, "write")
			e.gauge(m.inflight, float64(p.Inflight()), name, pn)
			cur := p.State()
			for _, s := range []string{"connected", "disconnected"} {
				v := 0.0
				if s == cur {
					v = 1
				}
				e.gauge(m.state, v, name, pn, s)
			}
			if rtt := p.CurLatency(); rtt > 0 {
				e.gauge(m.hbRTT, rtt.Seconds(), name, pn)
			}
		}
	}
	if m.RNBD == nil {
		return
	}
	st := &m.RNBD.Stats
	for op, c := range map[string]uint64{"read": st.Reads.Total(), "write": st.Writes.Total(), "flush": st.Flushes.Total(),
		"discard": st.Discards.Total(), "write_zeroes": st.WriteZeroes.Total()} {
		e.counter(m.rnbdReqs, c, op)
	}
	e.counter(m.rnbdZC, st.ZeroCopyReads.Total())
	e.counter(m.rnbdFUA, st.FUAWrites.Total())
	e.counter(m.rnbdFlags, st.Preflushes.Total(), "preflush")
	e.counter(m.rnbdFlags, st.NoUnmapZeroes.Total(), "nounmap")
	e.counter(m.rnbdErrors, st.Errors.Total())
	perSess := map[string]int{}
	for _, ss := range sessions {
		perSess[ss.Name()] = 0
	}
	for _, d := range m.RNBD.Devices() {
		perSess[d.Session]++
		e.gauge(m.devOpen, 1, d.Session, d.Path, d.AccessMode.String())
	}
	for s, n := range perSess {
		e.gauge(m.devices, float64(n), s)
	}
}
