"""The restore path: from a lookup's plan to filled MLX arrays (`restoring` is where it starts)."""
