"""Test-session setup shared by every test module."""
import os

import torch

# Without a GPU the Triton kernels can only run under Triton's interpreter; it must be chosen before triton is
# imported anywhere, so it is set here rather than in each module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
