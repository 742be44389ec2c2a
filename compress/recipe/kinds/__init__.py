"""Stage kinds: one config class and one StageSpec per kind (no torch import); each kind's run
module is in compress.stages.

`KINDS` names the module of every kind, in listing order: the registry imports these and no
others (a new kind's module is added here).
"""

KINDS = ("finetune", "distill", "prune", "moefy", "quantize", "precision", "compile", "export",
         "search", "package")
