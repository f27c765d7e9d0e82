"""C++ kernels of the CPU path (paged attention, fused norms, RoPE, SwiGLU), built once per machine."""
