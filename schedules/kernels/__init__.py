"""Hand-written TIR kernels for the hot paths."""
