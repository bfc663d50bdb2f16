"""mistjax.runtime."""
