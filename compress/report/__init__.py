"""Reports of finished runs: the table, the plot, what runtimes the stages recorded, and timing
every artifact again.
"""
