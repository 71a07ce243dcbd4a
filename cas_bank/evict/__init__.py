"""Eviction: last uses, the leaf index, leaf-first eviction and its memory."""
