"""Infrastructure: storage (local or S3), streams, shard progress and results checkpoints, user paths,
the job store, the model registry, media, webhook delivery and the REST client of the batch API.
Imports only the core."""
