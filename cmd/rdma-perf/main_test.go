package main

import "testing"

// TestParamsRoundTrip: the parameters survive the trip through a connect's private data,
// also padded with zeros as an IB CM delivers it, and nonsense is refused.
func TestParamsRoundTrip(t *testing.T) {
	p := params{Test: "send_lat", Size: 8, Depth: 1, Poll: true}
	b := p.encode()
	for _, in := range [][]byte{b, append(append([]byte(nil), b...), make([]byte, 56-len(b))...)} {
		got, err := decodeParams(in)
		if err != nil || got != p {
			t.Fatalf("decode %q: %+v %v", in, got, err)
		}
	}
	for _, bad := range []string{"", "write_bw 1", "write_bw x 16", "write_bw 0 16", "write_bw 1 2000 poll", "write_bw 1 16", "write_bw 1 16 spin", "a b c d"} {
		if _, err := decodeParams([]byte(bad)); err == nil {
			t.Fatalf("%q accepted", bad)
		}
	}
}
