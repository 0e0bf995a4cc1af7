package transport

import (
	"fmt"

	"github.com/rtrs-go/rtrs/internal/lib/names"
)

// validName checks a session or path name a peer or a caller gives (names.Session) and wraps
// the refusal in ErrInvalName.
func validName(name string) error {
	if err := names.Session(name); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalName, err)
	}
	return nil
}
