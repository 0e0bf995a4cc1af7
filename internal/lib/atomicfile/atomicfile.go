// Package atomicfile replaces a file whole or not at all, across a crash or a power loss.
package atomicfile

import (
	"os"
	"path/filepath"
)

// Write puts data at path with mode perm: a new file beside it (".<name>.tmp-*") written and
// synced, renamed over path, then the directory synced. On any error path is as it was and
// the new file is gone.
func Write(path string, data []byte, perm os.FileMode) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Chmod(perm)
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
