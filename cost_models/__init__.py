"""Hardware-aware cost models: device catalog, compute, communication and memory.

Every function here is pure: hardware comes in as explicit dataclass arguments, never through
module-global state. Formulas and their sources are written out in docs/cost_model.md.
"""
