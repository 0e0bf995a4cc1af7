// Package atomicfile replaces a file whole or not at all, across a crash or a power loss.
package atomicfile

import (
	"os"
	"path/filepath"
	"syscall"
)

// Write puts data at path with mode perm: a new file beside it (".<name>.tmp-*") written and
// synced, renamed over path, then the directory synced. On any error path is as it was and
// the new file is gone.
func Write(path string, data []byte, perm os.FileMode) error {
	return write(path, data, perm, -1, -1)
}

// Replace is Write for a file an operator keeps: symlinks in path are followed (the file
// they lead to is replaced and the links stay, as a config kept in a managed checkout
// needs), and an existing file keeps its mode and owner; a new one gets perm.
func Replace(path string, data []byte, perm os.FileMode) error {
	if p, err := filepath.EvalSymlinks(path); err == nil {
		path = p
	}
	uid, gid := -1, -1
	if st, err := os.Stat(path); err == nil {
		perm = st.Mode().Perm()
		if s, ok := st.Sys().(*syscall.Stat_t); ok && (int(s.Uid) != os.Geteuid() || int(s.Gid) != os.Getegid()) {
			uid, gid = int(s.Uid), int(s.Gid)
		}
	}
	return write(path, data, perm, uid, gid)
}

func write(path string, data []byte, perm os.FileMode, uid, gid int) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Chmod(perm)
	}
	if err == nil && uid >= 0 {
		err = f.Chown(uid, gid)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		_ = os.Remove(f.Name())
		return err
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
