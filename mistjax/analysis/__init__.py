"""mistjax.analysis."""
