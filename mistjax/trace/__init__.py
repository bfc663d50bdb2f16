"""mistjax.trace."""
