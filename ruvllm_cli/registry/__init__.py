"""Model registry, name resolution, cache layout and downloads (no torch imports here)."""
