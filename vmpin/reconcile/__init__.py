"""Observe the node, plan it, apply the difference, audit it."""
