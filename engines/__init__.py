"""Engines: the adapters that speak to them, the per-request choice among them, and the rollout control plane.

:mod:`engines.adapters` translates each kind of upstream; :mod:`engines.selection` orders, caps and leases
a model's engines for one request; :mod:`engines.rollout` measures, decides and publishes the routing table,
and :mod:`engines.controller` is the loop that runs it against the pool.
"""
