"""Stage kinds: one config class and one StageSpec per kind (no torch import); each kind's run
module is in compress.stages.
"""
