"""CPU kernels: C sources (AVX2, AVX-512) built on first use by kernels.build, and their ctypes bindings."""
