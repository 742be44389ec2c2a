"""Datasets: loading, splitting and batching a recipe's data."""
