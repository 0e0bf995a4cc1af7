package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
)

// fileDisk serves a file: WRITEs with pwrite, READs with RespondFile (a READ beyond the
// source is refused by RespondFile and answered with EIO).
type fileDisk struct {
	f   *os.File
	src *FileSource
}

func (d *fileDisk) Request(r *SrvRequest) {
	off := int64(binary.LittleEndian.Uint64(r.Usr))
	if r.Dir == Write {
		if _, err := d.f.WriteAt(r.Data, off); err != nil {
			r.Respond(-5)
			return
		}
		r.Respond(0)
		return
	}
	if err := r.RespondFile(d.src, off); err != nil {
		r.Respond(-5)
	}
}

func (d *fileDisk) LinkEvent(*SrvSess, LinkEvent) {}

// TestRespondFile serves READs straight from a file over two paths, with and without
// always_invalidate: random IO checks every byte against a model, a READ past the file's
// end gets EIO, and once the source is closed READs fail while the paths stay up.
func TestRespondFile(t *testing.T) {
	for _, inv := range []bool{false, true} {
		t.Run(fmt.Sprintf("always_invalidate=%v", inv), func(t *testing.T) {
			leakcheck.Check(t)
			const size = 8 << 20
			model := make([]byte, size)
			for i := range model {
				model[i] = byte(i * 13)
			}
			name := filepath.Join(t.TempDir(), "disk")
			if err := os.WriteFile(name, model, 0o600); err != nil {
				t.Fatal(err)
			}
			f, err := os.OpenFile(name, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			d := &fileDisk{f: f, src: NewFileSource(f, size)}
			e := &env{prov: soft.New(soft.Options{})}
			o := DefaultServerOptions()
			o.Provider, o.Handler, o.Timings = e.prov, d, Timings(testutil.FastTimings())
			o.Addr = netip.MustParseAddrPort("127.0.0.1:0")
			o.AlwaysInvalidate = inv
			srv, err := NewServer(o)
			if err != nil {
				t.Fatal(err)
			}
			defer srv.Close()
			e.srv, e.port = srv, srv.Addr().Port()
			s := e.open(t, "filesess", paths(t, "ip:127.0.0.1@ip:127.0.0.1", "ip:127.0.0.2@ip:127.0.0.1"), nil)
			randomIO(t, s, model, 2000, 32, 7)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			read := func(off int) error {
				buf := make([]byte, 8192)
				done := make(chan error, 1)
				if err := s.Request(ctx, Read, offHdr(off), buf, func(err error) { done <- err }); err != nil {
					return err
				}
				if err := <-done; err != nil {
					return err
				}
				if !bytes.Equal(buf, model[off:off+len(buf)]) {
					return fmt.Errorf("read at %d: data differs", off)
				}
				return nil
			}
			if err := read(size - 4096); !errors.Is(err, syscall.EIO) {
				t.Fatalf("READ past the end of the source: %v", err)
			}
			if err := read(4096); err != nil {
				t.Fatal(err)
			}
			d.src.Close()
			if err := read(4096); !errors.Is(err, syscall.EIO) {
				t.Fatalf("READ from a closed source: %v", err)
			}
			for _, p := range s.Paths() {
				if p.State() != StateConnected {
					t.Fatalf("%s %v after refused READs", p.Name(), p.State())
				}
			}
		})
	}
}
