package transport

import "time"

// Timings are the protocol's timers. Zero fields take the kernel's values.
type Timings struct {
	HeartbeatInterval time.Duration // RTRS_HB_INTERVAL_MS, 5 s
	HeartbeatMissed   int           // RTRS_HB_MISSED_MAX, 5
	ConnectTimeout    time.Duration // RTRS_CONNECT_TIMEOUT_MS, 30 s
	ReconnectDelay    time.Duration // reconnect_delay_sec as RNBD passes it, 30 s
	ReconnectBackoff  time.Duration // RTRS_RECONNECT_BACKOFF, 1 s
	ZombieTimeout     time.Duration // RTRS_MAX_CONN_TIMEOUT, 30 s
}

func (t Timings) withDefaults() Timings {
	if t.HeartbeatInterval <= 0 {
		t.HeartbeatInterval = 5 * time.Second
	}
	if t.HeartbeatMissed <= 0 {
		t.HeartbeatMissed = 5
	}
	if t.ConnectTimeout <= 0 {
		t.ConnectTimeout = 30 * time.Second
	}
	if t.ReconnectDelay <= 0 {
		t.ReconnectDelay = 30 * time.Second
	}
	if t.ReconnectBackoff < 0 {
		t.ReconnectBackoff = 0
	} else if t.ReconnectBackoff == 0 {
		t.ReconnectBackoff = time.Second
	}
	if t.ZombieTimeout <= 0 {
		t.ZombieTimeout = 30 * time.Second
	}
	return t
}
