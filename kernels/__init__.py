"""autopar.kernels: fused communication kernels for use inside ``jax.shard_map``."""
