"""kilnlm.runtime.distribution: getting built engines to the servers that run them.

The other job of the runtime besides running an engine. Modules, one owner each:

- ``refs``: the grammar of cache references (keys, ``name:version``, ``<cache URL>/<ref>``);
- ``object_store``: a flat namespace of objects under one URL (local directory or S3 through fsspec),
  with atomic and create-only writes;
- ``cache``: :class:`~kilnlm.runtime.distribution.cache.EngineCache`, engines stored by cache key with
  names and versions pointing at keys (``kilnlm cache ...``); atomic publish, verified fetch;
- ``engine_source``: where a served Triton model's engine comes from (a version's engine copy, its
  ``engine.json`` pointer, or the model's ``engine_ref`` / ``engine_dir`` parameter);
- ``deploy``: ``kilnlm deploy``, writing an engine into a Triton model repository as a new version.

Dependencies run one way: deploy -> engine_source -> cache -> object_store, refs. Nothing here imports
kilnlm.builder or transformers (a serving image resolves cached engines at load time).
"""
