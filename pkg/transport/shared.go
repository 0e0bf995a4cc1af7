package transport

// The values a user of the client side and a user of the server side both see.

// Dir is the direction of a request.
type Dir int

// Directions.
const (
	Read Dir = iota
	Write
)

func (d Dir) String() string {
	if d == Read {
		return "READ"
	}
	return "WRITE"
}

// LinkEvent is a session-level connectivity change: the server's Handler.LinkEvent and the
// client's ClientOptions.OnLinkEvent report them.
type LinkEvent int

// Link events (enum rtrs_srv_link_ev / rtrs_clt_link_ev).
const (
	LinkConnected LinkEvent = iota
	LinkDisconnected
	LinkReconnected
)

func (e LinkEvent) String() string {
	return [...]string{"CONNECTED", "DISCONNECTED", "RECONNECTED"}[e]
}
