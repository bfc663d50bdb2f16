"""mistjax.train."""
