package transport

import (
	"fmt"
	"os"
	"sync"
	"syscall"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// FileSource is a file that READ responses may carry data from without a copy into the
// chunk (SrvRequest.RespondFile). Each path registers it as a file region of its protection
// domain (rdma.PD.RegFileMR) when a response first names it; Close deregisters it everywhere.
type FileSource struct {
	f    *os.File
	size int64

	mu     sync.Mutex
	closed bool
	paths  map[*SrvPath]struct{}
}

// NewFileSource makes f, of size bytes, a source for RespondFile. The source does not own f:
// the regions hold descriptors of their own, so f may be closed after the source.
func NewFileSource(f *os.File, size int64) *FileSource {
	return &FileSource{f: f, size: size, paths: map[*SrvPath]struct{}{}}
}

// Close deregisters the source from every path; later RespondFile calls fail.
func (fs *FileSource) Close() {
	fs.mu.Lock()
	fs.closed = true
	paths := fs.paths
	fs.paths = nil
	fs.mu.Unlock()
	for p := range paths {
		p.mu.Lock()
		mr := p.fileMRs[fs]
		delete(p.fileMRs, fs)
		p.mu.Unlock()
		if mr != nil {
			_ = mr.Dereg()
		}
	}
}

// fileMR returns the path's region for fs, registering it the first time. Lock order:
// fs.mu before p.mu.
func (p *SrvPath) fileMR(fs *FileSource) (rdma.MR, error) {
	p.mu.Lock()
	mr := p.fileMRs[fs]
	p.mu.Unlock()
	if mr != nil {
		return mr, nil
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if fs.closed {
		return nil, fmt.Errorf("rtrs: file source closed: %w", syscall.ENODEV)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if mr := p.fileMRs[fs]; mr != nil {
		return mr, nil
	}
	if p.pd == nil || p.state != srvConnected {
		return nil, fmt.Errorf("rtrs: file region on a path that is not connected: %w", syscall.ENOTCONN)
	}
	mr, err := p.pd.RegFileMR(fs.f, 0, int(fs.size), 0)
	if err != nil {
		return nil, err
	}
	if p.fileMRs == nil {
		p.fileMRs = map[*FileSource]rdma.MR{}
	}
	p.fileMRs[fs] = mr
	fs.paths[p] = struct{}{}
	return mr, nil
}

// dropFileMRs deregisters the path's file regions (path close).
func (p *SrvPath) dropFileMRs() {
	p.mu.Lock()
	mrs := p.fileMRs
	p.fileMRs = nil
	p.mu.Unlock()
	for fs, mr := range mrs {
		fs.mu.Lock()
		delete(fs.paths, p)
		fs.mu.Unlock()
		_ = mr.Dereg()
	}
}
