"""GPU kernels in Triton, and the packed12 weight format they read."""
