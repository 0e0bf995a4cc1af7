package errno

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"testing"
)

// The wrapped errno wins; then a context's end, a missing file; anything else is EIO.
func TestOf(t *testing.T) {
	for _, c := range []struct {
		err  error
		want syscall.Errno
	}{
		{nil, 0},
		{fmt.Errorf("x: %w", syscall.ENOSPC), syscall.ENOSPC},
		{fmt.Errorf("x: %w (%w)", syscall.EBUSY, context.DeadlineExceeded), syscall.EBUSY},
		{fmt.Errorf("x: %w", context.DeadlineExceeded), syscall.ETIMEDOUT},
		{context.Canceled, syscall.EINTR},
		{fmt.Errorf("open: %w", os.ErrNotExist), syscall.ENOENT},
		{errors.New("something"), syscall.EIO},
	} {
		if got := Of(c.err); got != c.want {
			t.Errorf("Of(%v) = %v, want %v", c.err, got, c.want)
		}
		if got := Neg(c.err); got != -int(c.want) {
			t.Errorf("Neg(%v) = %d, want %d", c.err, got, -int(c.want))
		}
	}
}
