"""PyTorch references of every op in k3core.ops (the oracle and the CPU path)."""
