"""Batch captioning at dataset scale: sources (files, WebDataset shards, Parquet, URL
lists) read a shard at a time, a pipeline that prepares media in worker processes ahead
of the engine, sinks (JSONL, Parquet, WebDataset) written shard by shard with resume,
the Ray Data runner and the ``pie-media caption`` command. Not HTTP: the service's
caption-jobs route reuses its records (``api.batch.records``)."""
