"""Sharding: plans, collectives, and running a model over sharded parameters."""
