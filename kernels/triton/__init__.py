"""Portable Triton kernels shared by the NVIDIA and AMD backends (imported only by backends/)."""
