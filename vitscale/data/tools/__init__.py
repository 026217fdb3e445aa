"""Offline dataset tools behind ``vitscale shards``: :mod:`~vitscale.data.tools.write` (from the
image :mod:`~vitscale.data.tools.sources`), :mod:`~vitscale.data.tools.verify` (verify and stats),
:mod:`~vitscale.data.tools.dedup` and :mod:`~vitscale.data.tools.bench`.
"""
