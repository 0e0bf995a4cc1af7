#include "textflag.h"

// func ntStore(dst, src *byte, n uintptr)
// n is a multiple of 128 (possibly 0) and dst 16-byte aligned. X0-X7 are scratch registers
// in both of Go's calling conventions.
TEXT ·ntStore(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	TESTQ CX, CX
	JZ done
loop:
	MOVOU 0(SI), X0
	MOVOU 16(SI), X1
	MOVOU 32(SI), X2
	MOVOU 48(SI), X3
	MOVOU 64(SI), X4
	MOVOU 80(SI), X5
	MOVOU 96(SI), X6
	MOVOU 112(SI), X7
	MOVNTO X0, 0(DI)
	MOVNTO X1, 16(DI)
	MOVNTO X2, 32(DI)
	MOVNTO X3, 48(DI)
	MOVNTO X4, 64(DI)
	MOVNTO X5, 80(DI)
	MOVNTO X6, 96(DI)
	MOVNTO X7, 112(DI)
	ADDQ $128, SI
	ADDQ $128, DI
	SUBQ $128, CX
	JNZ loop
	// Non-temporal stores are weakly ordered: fence them before the caller's next store
	// (the IO's completion) can be seen.
	SFENCE
done:
	RET
