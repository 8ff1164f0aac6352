"""The shard gRPC service: the engine bound to one device behind a thin servicer."""
