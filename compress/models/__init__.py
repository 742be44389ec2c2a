"""Models and their folders: the bundle passed between stages, loading, saving and reading back
every model form.
"""
