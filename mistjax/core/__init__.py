"""The shared vocabulary every layer of mistjax reads and none owns.

The plan contract (`plan`) and what it implies for a stage (`stages`), pipeline schedule tables and
time formulas (`schedules`, `pipeline_time`), how state leaves are laid out and offloaded
(`layout`, `axes`), remat / offload policy names (`policies`), the contract between tuner and cost
model (`strategies`), and the reader of compiled HLO (`hlo`). Nothing here imports another
mistjax package.
"""
