"""Running a recipe: the stage loop, one stage at a time with its cache key, and the
fingerprints of a run's inputs.
"""
