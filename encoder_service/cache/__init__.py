"""The shared encoder cache: its books, the shard actor, the client, uuid names, the ingress's near cache and the embeddings a replica owns."""
