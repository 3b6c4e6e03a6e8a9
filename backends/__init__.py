"""Vendor backends; each registers its providers with k3core.backend when loaded."""
