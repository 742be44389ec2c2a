"""The search stage: candidates built from the stages compress has, each measured; the winner
picked by timing the finalists.
"""
