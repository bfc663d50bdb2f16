"""mistjax.validate: checks of the cost model against measurements (top layer: may import everything).

`mistjax.validate.published` reads files of published training runs and predicts them.
"""
