"""Plain-PyTorch references and oracles the kernels are tested against (no compiled code)."""
