"""The classifier family (sequence classifiers and `module:factory` models): its functions
are in `family`; its stages run through each kind's shared runner in `compress.stages`.
"""
