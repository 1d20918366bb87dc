"""Engine adapters: one per kind of upstream, all speaking :mod:`engines.base`."""
