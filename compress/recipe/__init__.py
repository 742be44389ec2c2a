"""Recipes without torch: the schema, YAML files, the stage registry and every kind's config,
model and data sources, model families.
"""
