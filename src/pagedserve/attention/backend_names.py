"""Backend names that option checks read without importing torch (the backends import it)."""
from __future__ import annotations

# The one attention backend on cuda (triton_backend.py), the default there.
TRITON_BACKEND = "triton"
