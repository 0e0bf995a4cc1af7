//go:build race

package transport

// raceDetector: the race detector's shadow memory and its slowdown make the load test's
// figures meaningless; scripts/test.sh runs that test without it.
const raceDetector = true
