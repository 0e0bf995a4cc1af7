package transport

import (
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"runtime/debug"
	"sort"
	"sync"
	"syscall"
	"time"

	"github.com/google/uuid"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// SrvSess is a server session: the chunks its paths share, keyed by the client's session uuid.
type SrvSess struct {
	srv   *Server
	uuid  uuid.UUID
	owner Identity
	// client is what MaxSessionsPerClient counts the session under (clientKey).
	client string
	// Counted in Server.newSessFrom[newFrom] until its first INFO_REQ (Server.mu).
	newFrom netip.Addr
	isNew   bool

	mu          sync.Mutex
	mem         []byte // the chunks, from the first INFO_REQ on
	memCleanup  runtime.Cleanup
	stuck       bool // a path closed with requests still handed up: the chunks may be in use
	gone        bool // the last path closed: no chunks are allocated any more
	name        string
	paths       map[uuid.UUID]*SrvPath
	established int
	live        int // paths not closing: a session without any does not hold its name
}

// Owner is the identity of the client that created the session.
func (ss *SrvSess) Owner() Identity { return ss.owner }

// Name is the client's session name (empty until a path has sent INFO_REQ).
func (ss *SrvSess) Name() string {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.name
}

// Paths lists the session's connected paths by name.
func (ss *SrvSess) Paths() []*SrvPath {
	var out []*SrvPath
	for _, p := range ss.pathList() {
		if p.State() == "connected" {
			out = append(out, p)
		}
	}
	return out
}

// ListedPaths lists the paths that have connected and are not yet gone, closing ones
// included: the kernel creates a path's sysfs directory at INFO_REQ and removes it when
// the close has finished.
func (ss *SrvSess) ListedPaths() []*SrvPath {
	var out []*SrvPath
	for _, p := range ss.pathList() {
		p.mu.Lock()
		listed := p.listed
		p.mu.Unlock()
		if listed {
			out = append(out, p)
		}
	}
	return out
}

// holdsName says whether the session still claims its name: a client that closed its session
// and opens a new one of the same name must not be refused while the old one winds down.
func (ss *SrvSess) holdsName() bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.live > 0
}

func (ss *SrvSess) pathList() []*SrvPath {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	out := make([]*SrvPath, 0, len(ss.paths))
	for _, p := range ss.paths {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name() < out[j].Name() })
	return out
}

// chunkMem returns the session's chunks, allocating them the first time within the server's
// MaxChunkMemory.
func (ss *SrvSess) chunkMem() ([]byte, error) {
	ss.mu.Lock()
	mem, gone := ss.mem, ss.gone
	ss.mu.Unlock()
	if mem != nil {
		return mem, nil
	}
	if gone {
		return nil, fmt.Errorf("rtrs: session closed: %w", syscall.ECONNRESET)
	}
	// The server's lock is never taken under a session's (the other order is everywhere):
	// the charge first, then the session, and the loser of a race gives its copy back.
	srv := ss.srv
	n := int64(srv.opts.QueueDepth) * int64(srv.opts.ChunkSize)
	if err := srv.chargeMem(ss.client, n); err != nil {
		return nil, err
	}
	mem, err := rdma.Alloc(int(n))
	if err != nil {
		srv.unchargeMem(ss.client, n)
		return nil, fmt.Errorf("rtrs: chunk memory for the session: %w", err)
	}
	ss.mu.Lock()
	if ss.mem != nil || ss.gone {
		have, gone := ss.mem, ss.gone
		ss.mu.Unlock()
		_ = rdma.Free(mem)
		srv.unchargeMem(ss.client, n)
		if gone {
			return nil, fmt.Errorf("rtrs: session closed: %w", syscall.ECONNRESET)
		}
		return have, nil
	}
	ss.mem = mem
	// Normally freed when the last path has closed (freeMem); if a handler still held a
	// request then, only once nothing can reach the session any more.
	client := ss.client
	ss.memCleanup = runtime.AddCleanup(ss, func(mem []byte) {
		_ = rdma.Free(mem)
		srv.unchargeMem(client, int64(len(mem)))
	}, mem)
	ss.mu.Unlock()
	return mem, nil
}

// freeMem returns the chunks to the system when the session has gone and no handler holds a
// request of it; called once, after the last path closed.
func (ss *SrvSess) freeMem() {
	ss.mu.Lock()
	mem, stuck := ss.mem, ss.stuck
	if mem != nil && !stuck {
		ss.memCleanup.Stop()
		ss.mem = nil
	}
	ss.mu.Unlock()
	if mem == nil || stuck {
		return
	}
	_ = rdma.Free(mem)
	ss.srv.unchargeMem(ss.client, int64(len(mem)))
	ss.srv.returnMem()
}

// memReturnDelay gathers the sessions that go together (clients that exited at once) into
// one return of memory to the system.
const memReturnDelay = time.Second

// returnMem hands the Go heap that sessions leave behind back to the system, memReturnDelay
// after a session has gone (one run for all that go meanwhile). Their chunks are unmapped
// already; what is left are their connections' buffers, goroutine stacks and request state.
// The collector would keep that resident: a server that goes idle allocates nothing, so no
// collection comes for two minutes, and the scavenger keeps what lies under the last heap
// goal, twice the live heap of the busy server.
func (s *Server) returnMem() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.memReturn != nil || s.closed {
		return
	}
	s.memWG.Add(1)
	s.memReturn = time.AfterFunc(memReturnDelay, func() {
		defer s.memWG.Done()
		s.mu.Lock()
		s.memReturn = nil
		s.mu.Unlock()
		debug.FreeOSMemory()
	})
}

// errClientMemory marks a refusal by MaxChunkMemoryPerClient, logged under its own cause.
var errClientMemory = errors.New("the client's chunk memory")

// chargeMem puts n bytes of chunk memory on the server's account and on client's, within
// MaxChunkMemory and MaxChunkMemoryPerClient.
func (s *Server) chargeMem(client string, n int64) error {
	lim := s.opts.Limits
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.chunkMemory+n > lim.MaxChunkMemory {
		return fmt.Errorf("rtrs: chunk memory of %d bytes for the session: %d of %d in use: %w", n, s.chunkMemory, lim.MaxChunkMemory, syscall.ENOMEM)
	}
	if have := s.clientMemory[client]; have+n > lim.MaxChunkMemoryPerClient {
		return fmt.Errorf("rtrs: chunk memory of %d bytes for the session: its client's sessions hold %d of the %d allowed per client: %w: %w", n, have, lim.MaxChunkMemoryPerClient, errClientMemory, syscall.ENOMEM)
	}
	s.chunkMemory += n
	s.clientMemory[client] += n
	return nil
}

// unchargeMem takes n bytes of chunk memory off the server's account and off client's.
func (s *Server) unchargeMem(client string, n int64) {
	s.mu.Lock()
	s.chunkMemory -= n
	if s.clientMemory[client] -= n; s.clientMemory[client] <= 0 {
		delete(s.clientMemory, client)
	}
	s.mu.Unlock()
}

// ChunkMemory is the chunk memory the server's sessions hold, in bytes.
func (s *Server) ChunkMemory() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.chunkMemory
}
