"""The run folder on disk: atomic writes, digests, the run lock, and the typed manifest records
(no torch).
"""
