"""shardlab: JAX-style, functional sharding for PyTorch."""
