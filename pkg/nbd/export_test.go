package nbd

import "testing"

// RawClient lets the external tests (clients_test.go) send single requests through the
// in-package test client.
type RawClient struct{ c *client }

// DialRaw connects to the export name on the unix socket sock.
func DialRaw(t testing.TB, sock, name string) RawClient { return RawClient{dial(t, sock, name)} }

// Flags are the export's transmission flags.
func (r RawClient) Flags() uint16 { return r.c.flags }

// Do sends one request without a read payload and returns the reply's errno.
func (r RawClient) Do(req Request, payload []byte) uint32 {
	r.c.send(req, payload)
	_, errno, _ := r.c.recv(0)
	return errno
}

// Transmission flags the external tests look at.
const (
	TFlagSendTrim    = tflagSendTrim
	TFlagWriteZeroes = tflagWriteZeroes
)
