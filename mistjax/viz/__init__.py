"""mistjax.viz."""
