//go:build !race

// Package racebuf tells the race detector what a raw system call wrote (golang.org/x/sys's
// wrappers record that for the calls they make; unix.RawSyscall does not): under -race a
// buffer the kernel filled is then seen as written by the caller, so that a goroutine reading
// it without ordering is reported. Assembly that reads or writes Go memory (ntcopy) says so
// through it too. Unlike the wrappers, it adds no ordering between one
// system call and another (x/sys's ioSync). Without -race, nothing.
package racebuf

// Written tells the race detector that p was written; without -race it does nothing.
func Written([]byte) {}

// Read tells the race detector that p was read; without -race it does nothing.
func Read([]byte) {}
