// Package fsview shows the daemons' state as sysfs-like trees over FUSE: one attribute model
// (the kernel's show/store pairs, declared per directory type) and a go-fuse node type for
// each kind of Entry: directories, attribute files, block-device files and symbolic links.
package fsview

import (
	"context"
	"fmt"
	"syscall"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/names"
)

// Attr is one file of a directory (the kernel's DEVICE_ATTR).
type Attr struct {
	Name string
	// Mode is the permission: 0444 read-only, 0644 read and write (control and reset files).
	Mode uint32
	// Show renders the content; it runs once per open. Action files show their usage.
	Show func() string
	// Store performs a write; nil makes the file read-only (write opens are refused). It gets
	// the written text with one trailing newline removed; a returned error goes back to the
	// writer as its errno. A store may block for as long as the daemon's own timeouts allow:
	// FUSE interrupts do not cut it short, so an action never runs twice.
	Store func(val string) error
}

// Block is a block device shown as a regular file of its size.
type Block interface {
	Size() int64
	BlockSize() int
	ReadAtContext(ctx context.Context, p []byte, off int64) error
	WriteAtContext(ctx context.Context, p []byte, off int64, fua bool) error
	Flush(ctx context.Context) error
}

// Entry is one name in a directory: a file, a subdirectory, a block device or a symbolic
// link (Link, its target, as sysfs links one object to another).
type Entry struct {
	Name  string
	Attr  *Attr
	Dir   Dir
	Block Block
	Link  string
	// Obj is the object a directory shows (a session, a path), where another one can come
	// to have the same name: the name then gets a new inode. Comparable; nil for none.
	Obj any
}

// Dir is a directory type: it lists its entries on every lookup and listing, so the tree
// always shows the state of the moment (a removed path is gone at once).
type Dir interface {
	Entries() []Entry
}

// DirFunc adapts a function to Dir.
type DirFunc func() []Entry

// Entries calls f.
func (f DirFunc) Entries() []Entry { return f() }

// validEntry says whether a name a user or a peer chose can be an entry of a tree
// (names.Component); entries that cannot are left out of the listing.
func validEntry(name string) bool { return names.Component(name) == nil }

// mountTime is the time every file shows (sysfs files show their creation time).
var mountTime = time.Now()

// guarded is a directory of an object that can go away (a session, a path) while a shell
// sits in it or a file of it is open: once alive says no, it lists nothing, and its files'
// stores fail with ENODEV and do nothing, as sysfs answers for a removed kobject. Without
// it, a directory kept across a close and reopen of the same name would act on the old
// object.
func guarded(what string, alive func() bool, d Dir) Dir {
	return DirFunc(func() []Entry {
		if !alive() {
			return nil
		}
		ents := d.Entries()
		out := make([]Entry, len(ents))
		for i, e := range ents {
			switch {
			case e.Attr != nil && e.Attr.Store != nil:
				a := *e.Attr
				store := a.Store
				a.Store = func(v string) error {
					if !alive() {
						return fmt.Errorf("%s is gone: %w", what, syscall.ENODEV)
					}
					return store(v)
				}
				e.Attr = &a
			case e.Dir != nil:
				e.Dir = guarded(what, alive, e.Dir)
			}
			out[i] = e
		}
		return out
	})
}
