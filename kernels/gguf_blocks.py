"""`python -m specpilot.kernels.gguf_blocks --bench MODEL.gguf [--rows R] [--threads T] [--json]`: the CPU block kernel's
benchmark (kernels/bench/gguf_cpu.py), at the command the results and issues cite. The kernel itself is
kernels/cpu/gguf_blocks.py."""

from specpilot.kernels.bench.gguf_cpu import main

if __name__ == "__main__":
    raise SystemExit(main())
