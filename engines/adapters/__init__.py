"""Engine adapters: one per kind of upstream, all speaking :mod:`engines.adapters.base`, and their settings."""
